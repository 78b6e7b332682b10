"""``aiayn <stage> ...``: one subcommand per pipeline stage, each the stage module's ``main``."""

from __future__ import annotations

import importlib
import sys

# subcommand -> (module, one-line help); modules are imported only when their command runs,
# so `aiayn train` on a bare GPU image never imports mlflow's or snakemake's dependencies.
COMMANDS = {
    "demo": ("aiayn.demo", "write the synthetic demo corpus"),
    "download": ("aiayn.data", "fetch a parallel corpus (hub, local files or the demo)"),
    "bpe": ("aiayn.bpe", "learn the shared SentencePiece BPE vocabulary"),
    "binarize": ("aiayn.binarize", "encode text into token-id arrays"),
    "params": ("aiayn.params", "parameter count of every preset beside the paper's"),
    "preflight": ("aiayn.preflight", "a workflow's disk, time and traps before any job runs"),
    "train": ("aiayn.train.launch", "train one model preset"),
    "average": ("aiayn.average", "average the last K checkpoints"),
    "decode": ("aiayn.decode", "beam-search a binarized or text split"),
    "translate": ("aiayn.translate", "translate stdin to stdout with a trained model"),
    "score": ("aiayn.score", "sacreBLEU, paper-comparable tokenized BLEU and chrF"),
    "reference": ("aiayn.reference", "a reference curve with its seed band from finished runs"),
    "report": ("aiayn.report", "Table 2 and Table 3 beside the paper's numbers"),
    "explore": ("aiayn.explore", "an HTML page of every attention layer and head of a model"),
    "compare": ("aiayn.compare", "compare runs from MLflow"),
    "export": ("aiayn.export", "a trained model as CTranslate2 or Hugging Face (Marian)"),
}

# old spellings still accepted, with a warning: old name -> command
DEPRECATED = {"binarise": "binarize"}


def usage() -> str:
    lines = ["usage: aiayn [--log FILE [--attempt N]] <command> [options]", "", "commands:"]
    lines += [f"  {name:<10} {help_text}" for name, (_, help_text) in COMMANDS.items()]
    lines += ["", "`aiayn <command> --help` describes each command's options.",
              "--log FILE: all output into FILE; --attempt N: the scheduler's attempt, so that a retry of a",
              "command whose last attempt ended with a user error (status 2) is not run again (the rules pass both)."]
    return "\n".join(lines)


def job_options(argv: list[str]) -> tuple[str | None, int, list[str]]:
    """The leading ``--log FILE`` and ``--attempt N`` (in either order), and the rest of ``argv``."""
    log, attempt = None, 1
    while argv and argv[0] in {"--log", "--attempt"}:
        if len(argv) < 2:
            raise ValueError(f"{argv[0]} needs a value")
        if argv[0] == "--log":
            log = argv[1]
        else:
            try:
                attempt = int(argv[1])
            except ValueError:
                attempt = 0
            if attempt < 1:
                raise ValueError(f"--attempt {argv[1]!r} is not a whole number of at least 1")
        argv = argv[2:]
    return log, attempt, argv


def run(command: str, rest: list[str]) -> int:
    module = importlib.import_module(COMMANDS[command][0])
    try:
        return int(module.main(rest) or 0)
    except BrokenPipeError:  # `aiayn ... | head`: the reader left, which is not an error
        sys.stderr.close()
        return 0


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        log, attempt, argv = job_options(argv)
    except ValueError as error:
        print(f"error: aiayn: {error}; see `aiayn --help`", file=sys.stderr)
        return 2
    if not argv or argv[0] in {"-h", "--help"}:
        print(usage())
        return 0
    command, rest = argv[0], argv[1:]
    if command in DEPRECATED:
        print(f"warning: `aiayn {command}` is deprecated; use `aiayn {DEPRECATED[command]}`", file=sys.stderr)
        command = DEPRECATED[command]
    if command not in COMMANDS:
        print(f"error: unknown command {command!r}; `aiayn --help` lists the commands", file=sys.stderr)
        return 2
    if log is None:
        return run(command, rest)
    from aiayn.joblog import run_logged

    return run_logged(log, attempt, argv, lambda: run(command, rest))


if __name__ == "__main__":
    raise SystemExit(main())
