"""`rosechat bench`: the rosechat engine side by side with `transformers`, in one process."""

from rosechat.bench import cli, parity


def main(argv: list[str]) -> int:
    if argv[:1] == ["parity"]:
        return parity.main(argv[1:])
    if argv[:1] == ["quant"]:  # the CPU routes for packed weights on a model's shapes (quant.py)
        from rosechat.bench import quant

        return quant.main(argv[1:])
    if argv[:1] == ["serve"]:  # rosechat serve under load, beside the in-process engine (serve.py)
        from rosechat.bench import serve

        return serve.main(argv[1:])
    if argv[:1] == ["app"]:  # the app's tok/s and key latency against the engine's, one run (app_bench.py)
        from rosechat.bench import app_bench

        return app_bench.main(argv[1:])
    if argv[:1] == ["structured"]:  # a batch's step time with 4 of 8 rows held to a JSON Schema (structured.py)
        from rosechat.bench import structured

        return structured.main(argv[1:])
    if argv[:1] == ["spec"]:  # speculative decoding against plain, one chat at a time, llama.cpp beside (spec.py)
        from rosechat.bench import spec

        return spec.main(argv[1:])
    if argv[:1] == ["scale"]:  # rosechat and llama.cpp on a random GGUF of a real model's shape (scale.py)
        from rosechat.bench import scale

        return scale.main(argv[1:])
    return cli.main(argv)


__all__ = ["main"]
