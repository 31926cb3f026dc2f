"""The engine: requests, the scheduler and block manager, the model runner, sampling, LLMEngine, TP ranks."""
