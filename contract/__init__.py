"""What the layers agree on and none of them owns: the plan contract between the scheduler, the model
runner and the app (`contract.plan`). Torch-free, and it imports nothing of fairlane's."""
