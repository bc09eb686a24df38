"""Text generation from causal language models, with a KV cache.

`generate` continues prompts with tfmgpu's `gpt` or a keras_hub
`CausalLM`: the prompt is read once, then one compiled decode step per
token (`decode`), on one device, with the rows spread over a strategy's
replicas, or on a model placed by `hybrid.build_layout` (each layer's
cache on its devices). Modules: `api` (the entry points), `prompts`
(reading a request), `decode` (the loop), `samplers`, the cache adapters
`gpt_cache`, `hub_cache` and `hub_blocks` (a placed keras_hub model, block
by block), and `placed` (placed models' copies and stages).
"""

from tfmgpu.generation.api import adapter_for
from tfmgpu.generation.api import generate
from tfmgpu.generation.api import Generator
from tfmgpu.generation.samplers import Sampling
from tfmgpu.generation.streaming import prompt_cut
from tfmgpu.generation.streaming import stream_tokens

__all__ = ["adapter_for", "generate", "Generator", "Sampling", "prompt_cut",
           "stream_tokens"]
