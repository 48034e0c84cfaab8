"""In-process benchmarks: the engine, scheduler and app driven from this process, and the executors
without a model they share with the tests. The top layer: it may import app and everything below;
nothing but tests imports it."""
