"""`phalanx serve`: an OpenAI-compatible server over the training code's own model.

One job per file:
- `block_manager`: the KV cache's blocks (free list, reference counts, prefix cache), plain data;
- `scheduler`: which sequences run each step and how many tokens each feeds, plain data;
- `paged_cache`: the paged KV cache that attention reads and writes (the AttentionCache
  protocol of phalanx/model/kv_cache.py);
- `engine`: one step: the scheduler's batch through the model, then sampling;
- `detokenize`: ids to text pieces that never split a character or show a stop string;
- `api`, `api_requests`, `chat_template`, `metrics`, `server`: HTTP and what it shows;
- `tool_call_parsers`, `hermes_tool_calls`, `llama3_json_tool_calls`: tool calls read from a
  model's own text (tool_choice auto), one module per format;
- `cli`: the `phalanx serve` command;
- `slo_policy`, `slo_step_time`: `--ttft-ms/--tpot-ms`, step sizes and admission from a
  step-time predictor learned online;
- `pool_router`, `pool_server`, `pool_backend`, `pool_proxy`, `pool_metrics`, `pool_main`:
  `--pool NAME:PLAN`, per-class pools of engines behind one endpoint, and rank moves between them.

Importing this package does not import torch (`phalanx serve --help` stays cheap).
"""
