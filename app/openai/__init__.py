"""OpenAI's surface: chat and text completions (whole and streamed), their bodies and objects, tools,
sampling parameters, vLLM's /tokenize and /detokenize, and the whole-response service the Batch API
runs its items through."""
