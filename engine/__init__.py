"""The rosechat serving engine: paged KV cache, scheduler, models, sampler."""
