"""The bounds a sampling setting must keep, torch-free: `inference/sampling.py` checks them for
`phalanx generate` and the sampler, and the server's request parser (`serve/api_requests.py`,
also read by the pool front, which loads no torch) refuses a request outside them with a 400."""

MIN_TEMPERATURE = 1e-6
"""Below this, logits a trained model tells apart (by 1e-5 and more) differ by more than
float32's softmax resolves, so the draw is the greedy choice; and divided by a small enough
temperature the logits pass float32's largest value (3.4e38), where the softmax turns to nan."""

MIN_TOP_P = 1.2e-38
"""float32's smallest normal number (torch.finfo(torch.float32).tiny): the probability mass is
compared with top_p in float32, where a smaller top_p rounds towards 0 (the first token is
always kept, so anything this small is the greedy choice)."""

PENALTY_RANGE = (-2.0, 2.0)
"""Presence and frequency penalties, as OpenAI bounds them."""

MAX_REPETITION_PENALTY = 1e3
"""A repetition penalty divides or multiplies logits: past 1e3 float32 logits of a trained model
lose every difference that is left, as below MIN_TEMPERATURE; vLLM takes any value > 0."""

LOGIT_BIAS_RANGE = (-100.0, 100.0)
"""As OpenAI bounds it: -100 bans a token in practice, 100 forces it."""
