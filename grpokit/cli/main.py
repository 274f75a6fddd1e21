"""`grpokit train | rollout | infer | eval | view`. Parsing only; help answers before torch is imported."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import warnings

from grpokit.config.help import unknown_option_line
from grpokit.config.parse import parse_train_args
from grpokit.errors import GrpokitError
from grpokit.redaction import install_log_redaction, redact_line
from grpokit.server.cli import run_rollout_cli
from grpokit.viewer import write_report

USAGE = """usage: grpokit {train,rollout,infer,eval,view} [options]

  train     GRPO-family training (no options: the built-in demo)
  rollout   serve rollouts over HTTP for --vllm_mode server
  infer     completions and reward scores of a model on a dataset
  eval      pass@k, mean@K and greedy scores of a model on a dataset (K samples per prompt)
  view      a run's trajectory viewer: OUTPUT_DIR/report.html (--serve: live while it trains)
  options   train's options on one topic (`grpokit options` lists the topics)

`grpokit COMMAND --help` lists a command's options."""


def _fail(message: str, code: int = 2) -> None:
    print(f"grpokit: error: {redact_line(message)}", file=sys.stderr, flush=True)  # no key in an error line
    _exit_if_groups_linger(code)
    sys.exit(code)


_process_entry = False  # main() runs as the process's entry point (argv from sys.argv), not called by a test


def _exit_if_groups_linger(code: int) -> None:
    """As the process's entry, after a run that formed a process group: leave without finalizing the interpreter
    while torch's backend threads linger (distributed/processes.py, exit_if_groups_linger)."""
    if _process_entry and "torch.distributed" in sys.modules:
        # not at the top: it loads torch, and `grpokit --help` answers without it
        from grpokit.distributed.processes import exit_if_groups_linger

        exit_if_groups_linger(code)


def infer_parser(command: str = "infer") -> argparse.ArgumentParser:
    """`grpokit infer`, or `grpokit eval`: the same options, with eval's defaults sampling K = 4 per prompt."""
    evaluating = command == "eval"
    description = (
        "pass@k, mean@K and greedy scores per reward on a dataset, with 95% intervals over prompts."
        if evaluating
        else "Completions and reward scores on a dataset."
    )
    p = argparse.ArgumentParser(prog=f"grpokit {command}", description=description, allow_abbrev=False)
    p.add_argument(
        "--model",
        default=None,
        help="model or checkpoint folder (full or LoRA adapter); default: the built-in demo model",
    )
    p.add_argument("--dataset", default="builtin:arithmetic:test", help="dataset spec, as for train")
    p.add_argument("--reward_funcs", nargs="+", default=["accuracy"], help="reward functions that score")
    p.add_argument("--max_new_tokens", type=int, default=20)
    _add_sampling_options(p, evaluating)
    p.add_argument("--batch_size", type=int, default=64)
    p.add_argument("--limit", type=int, default=0, help="first N prompts only")
    p.add_argument("--system", default=None)
    p.add_argument("--torch_dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--external_plugins", nargs="*", default=[])
    p.add_argument(
        "--output",
        default="eval_results.jsonl" if evaluating else None,
        help="write the scores (first line) and the completions (greedy, then the samples, with `sample`) "
        "as JSON lines here",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = default)")
    p.add_argument(
        "--fast_decode",
        type=str.lower,
        default="true",
        choices=["true", "false"],
        help="grpokit's decode loop for Llama/Qwen2/Qwen3 models (false: HF generate)",
    )

    _strict_errors(p, f"grpokit {command}")
    return p


def _add_sampling_options(p: argparse.ArgumentParser, evaluating: bool) -> None:
    """The greedy pass and the K samples per prompt, with their pass threshold (eval samples by default)."""
    p.add_argument(
        "--temperature",
        type=float,
        default=1.0 if evaluating else 0.0,
        help="0 = greedy; with --num_generations_eval, the samples' temperature (the greedy pass is apart)",
    )
    p.add_argument("--top_p", type=float, default=1.0, help="the samples' nucleus sampling")
    p.add_argument("--top_k", type=int, default=-1, help="the samples' top-k (-1: off)")
    p.add_argument(
        "--num_generations_eval",
        type=int,
        default=4 if evaluating else None,
        help="also sample K completions per prompt and report pass@k (k = 1, 2, 4, ... and K), mean@K and "
        "greedy per reward" + ("" if evaluating else " (as `grpokit eval`)"),
    )
    p.add_argument(
        "--eval_pass_threshold",
        type=float,
        default=1.0,
        help="a sample passes (pass@k) when its reward is at least this",
    )


def view_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="grpokit view",
        description="The trajectory viewer of a run: one self-contained "
        "HTML file (curves, completions by step and group, per-token colouring); "
        "docs/viewer.md.",
        allow_abbrev=False,
    )
    p.add_argument("output_dir", help="the run's --output_dir (logging.jsonl, completions.jsonl)")
    p.add_argument("--output", default=None, help="where to write the page (default: OUTPUT_DIR/report.html)")
    p.add_argument(
        "--serve",
        action="store_true",
        help="also serve the page live on 127.0.0.1 while the run writes (it redraws when the logs grow)",
    )
    p.add_argument("--port", type=int, default=None, help="port for --serve (default 8765; 0: a free one)")
    p.add_argument(
        "--max_completion_steps",
        type=int,
        default=100,
        help="steps whose completions the page holds: the first, the last and evenly spaced ones",
    )

    _strict_errors(p, "grpokit view")
    return p


def _strict_errors(p: argparse.ArgumentParser, prog: str) -> None:
    """One line for a bad command line; an unknown option (no abbreviations: allow_abbrev=False) with the option
    it is closest to."""

    def error(message):
        flags = [s for a in p._actions for s in a.option_strings]
        _fail(unknown_option_line(message, flags, prog) or f"{prog}: {message} (see `{prog} --help`)")

    p.error = error


def run_view(rest: list[str]) -> None:
    """`grpokit view`: standard library only, torch is never imported."""
    args = view_parser().parse_args(rest)
    if args.port is not None and not args.serve:
        _fail("grpokit view: --port is for --serve; add --serve or drop --port")
    port = 8765 if args.port is None else args.port
    if not 0 <= port <= 65535:
        _fail(f"grpokit view: --port {port} is not a port; use 0-65535 (0: a free one)")
    if args.max_completion_steps < 1:
        _fail(
            f"grpokit view: --max_completion_steps {args.max_completion_steps} must be at least 1; use 1 or "
            "more (default 100)"
        )
    print(write_report(args.output_dir, args.output, args.max_completion_steps), flush=True)
    if args.serve:
        # not at the top: the live page is served on the web stack every grpokit surface has (fastapi)
        from grpokit.server.viewer_site import serve_viewer

        serve_viewer(args.output_dir, port, args.max_completion_steps)


def run_infer_cli(command: str, rest: list[str]) -> None:
    """`grpokit infer` and `grpokit eval`: parse, check what needs no model, then run."""
    parser = infer_parser(command)
    args = parser.parse_args(rest)
    k = args.num_generations_eval
    if k is not None and (k < 1 or args.temperature == 0):  # said before the model loads
        parser.error(
            f"--num_generations_eval {k}: must be at least 1, e.g. 4"
            if k < 1
            else f"--num_generations_eval {k} samples at --temperature, which is 0 (greedy, the separate "
            "pass); give --temperature 1.0 (or the training run's)"
        )
    # not at the top: inference loads torch and the model's stack, which parsing must not
    from grpokit.pipeline.infer import run_infer

    run_infer(args)


def _quiet_third_party() -> None:
    """Our own progress bar and summary are the output; silence per-file load/save bars of the libraries."""
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    logging.getLogger("accelerate").setLevel(logging.ERROR)
    # peft 0.21 reads transformers 5's deprecated `is_gradient_checkpointing` when wrapping a model
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
    except ImportError:
        pass


def main(argv: list[str] | None = None) -> None:
    global _process_entry
    _process_entry = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        if not argv:
            argv = ["train"]
        else:
            print(USAGE)
            return
    command, rest = argv[0], argv[1:]
    logging.basicConfig(
        level=os.environ.get("GRPOKIT_LOG_LEVEL", "WARNING").upper(), format="%(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("grpokit").setLevel(os.environ.get("GRPOKIT_LOG_LEVEL", "INFO").upper())
    install_log_redaction()  # no key or token in a log line (grpokit/redaction.py)
    if command != "view":  # the viewer loads no third-party library to quieten (and answers at once)
        _quiet_third_party()

    # the options of every command are parsed by torch-free modules imported at the top; the stack that runs a
    # command is imported here, not at the top: `grpokit --help` and `grpokit train --help` answer without torch
    # (STYLE.md, thin entry point), and one command never loads another's stack
    try:
        if command in ("train", "options"):  # `grpokit options TOPIC` is `grpokit train --help TOPIC`
            cfg = parse_train_args(rest if command == "train" else ["--help", *rest[:1]])
            from grpokit.pipeline.train import run_train

            run_train(cfg)
            _exit_if_groups_linger(0)
        elif command in ("infer", "eval"):
            run_infer_cli(command, rest)
        elif command == "view":
            run_view(rest)
        elif command == "rollout":
            run_rollout_cli(rest)
        else:
            _fail(f"unknown command {command!r}; use train, rollout, infer, eval, view or options")
    except GrpokitError as e:
        code = getattr(e, "exit_code", None)  # a run stopped by a signal after saving (runs/stops.py)
        if code is not None:
            if os.environ.get("RANK", "0") == "0":  # every process of a launch stopped at the same step
                print(f"grpokit: stopped: {redact_line(str(e))}", file=sys.stderr, flush=True)
            sys.exit(code)
        _fail(str(e))
    except KeyboardInterrupt:
        _fail(
            "interrupted; nothing was saved since the last checkpoint (continue with --resume_from_checkpoint latest)",
            130,
        )


if __name__ == "__main__":
    main()
