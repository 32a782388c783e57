"""`rosechat bench`: the rosechat engine side by side with `transformers`, in one process."""

from rosechat.bench import cli, parity


def main(argv: list[str]) -> int:
    if argv[:1] == ["parity"]:
        return parity.main(argv[1:])
    return cli.main(argv)


__all__ = ["main"]
