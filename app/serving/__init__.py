"""What every API surface shares on its way to the engine, whatever its wire shape: the handlers'
context, admission (keys, classes, quotas), and one request's output as detokenized, stop-checked text,
one choice or several."""
