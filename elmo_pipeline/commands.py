"""How every command ends: its exit status, with a user's error as one line and no traceback,
and an argument nobody knows named with the nearest known option. Shared by `elmo-pipeline`,
the torchrun entry and `python -m elmo_pipeline.pipelines.<command>`."""

from __future__ import annotations

import argparse
import contextlib
import difflib
import signal
import sys
import threading
from typing import Callable, Iterator, Sequence

# What a command raises for input it cannot use (a ConfigError or CheckpointError is a
# ValueError), or for a package the input needs that is not installed (fsspec's "Install s3fs
# to access S3"): a message and exit 2, no traceback. Anything else keeps its traceback.
USER_ERRORS = (OSError, ValueError, RuntimeError, ImportError)


class JobFailed(Exception):
    """A Beam job that started and then failed (a worker that died or raised): exit 1, with the
    runner's message, as for a job whose counts do not reconcile; not a user's error (2)."""


class Terminated(BaseException):
    """SIGTERM (what `timeout` and schedulers send), raised where the command is, so that what it
    was writing is taken away on the way out as for Ctrl-C; not an Exception, which code that
    handles errors would catch."""


def _terminate(signum: int, frame: object) -> None:
    raise Terminated()


@contextlib.contextmanager
def _sigterm_raises() -> Iterator[None]:
    """SIGTERM as Terminated while a command runs, where Python's default would end the process
    at once (`embed-file` left its temporary file). Only in the main thread, and only over the
    default: a handler of a caller's, or an ignored SIGTERM, stays; the jobs and pretrain put
    their own in place while they run."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return
    signal.signal(signal.SIGTERM, _terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


# control characters (but the tab) and Unicode's line and paragraph separators, as repr writes them
_ESCAPES = {code: repr(chr(code))[1:-1] for code in [*range(0x20), *range(0x7F, 0xA0), 0x2028, 0x2029]
            if code != ord("\t")}


def one_line(text: str) -> str:
    """`text` with its control characters escaped as repr does: a file name holding a newline (or
    an ESC, which a terminal would act on) made a one-line error span lines."""
    return text.translate(_ESCAPES)


def run_command(args: argparse.Namespace) -> int:
    """`args.func(args)`, with a user's error as one line on stderr (exit 2), a job that failed
    as one line (exit 1), Ctrl-C as one line (exit 130, as a shell reports SIGINT) and SIGTERM
    as one (exit 143)."""
    try:
        with _sigterm_raises():
            return args.func(args)
    except Terminated:
        print(f"elmo-pipeline {args.command}: terminated (SIGTERM)", file=sys.stderr)
        return 128 + signal.SIGTERM
    except JobFailed as exc:
        print(f"elmo-pipeline {args.command}: the job failed: {exc}", file=sys.stderr)
        return 1
    except USER_ERRORS as exc:
        print(f"elmo-pipeline {args.command}: error: {one_line(str(exc))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"elmo-pipeline {args.command}: interrupted", file=sys.stderr)
        return 130


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Every command's `--help`: descriptions as written, and each option's default after its help
    unless the help names it already or there is none to name (unset, a flag)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        default = action.default
        unset = default is None or default is False or default is argparse.SUPPRESS or default == []
        # a flag takes no value: the default of its dest is not its own (--no-grow-vocab's True is
        # growing the vocabulary, --top's shared dest defaults to "all")
        flag = action.nargs == 0
        if unset or flag or not action.option_strings or "default" in (action.help or ""):
            return action.help
        return f"{action.help or ''} (default: %(default)s)".lstrip()


def use_help_formatter(subparsers: argparse._SubParsersAction) -> None:
    for parser in subparsers.choices.values():
        parser.formatter_class = HelpFormatter


def job_main(command: str, description: str | None, add_args: Callable[[argparse.ArgumentParser], None],
             func: Callable[[argparse.Namespace], int], argv: Sequence[str] | None = None) -> int:
    """The entry point of a Beam job run as its own module (`python -m elmo_pipeline.pipelines.X`):
    its options parsed, what is left over Beam's (or an error naming it, see run_pipeline), and
    `func` run as `run_command` runs every command."""
    parser = argparse.ArgumentParser(prog=f"elmo-pipeline {command}", description=description,
                                     formatter_class=HelpFormatter)
    add_args(parser)
    args, args.beam_args = parser.parse_known_args(argv)
    refuse_repeated_options(parser, sys.argv[1:] if argv is None else argv)
    args.func, args.command = func, command
    return run_command(args)


def options_given(args: argparse.Namespace, add_args: Callable[[argparse.ArgumentParser], None]) -> set[str]:
    """The options in `args` (by dest) set to something other than None and the default that
    `add_args` gives them: what the command line asked for."""
    defaults = argparse.ArgumentParser(add_help=False)
    add_args(defaults)
    return {name for name, value in vars(args).items() if value is not None and value != defaults.get_default(name)}


def refuse_repeated_options(parser: argparse.ArgumentParser, argv: Sequence[str]) -> None:
    """Exits through `parser.error` (status 2) naming the options given twice with different values."""
    repeated = repeated_options(parser, argv)
    if repeated:
        parser.error("given more than once with different values, of which only the last would count: "
                     + "; ".join(repeated) + "; give each once")


def repeated_options(parser: argparse.ArgumentParser, argv: Sequence[str]) -> list[str]:
    """Options of one value (`--data X`) given more than once with different values, each as
    `--data ('a', 'b')`: argparse keeps the last and drops the others without a word."""
    values: dict[argparse.Action, list[str]] = {}
    for i, token in enumerate(argv):
        if token == "--":
            break
        name, eq, value = token.partition("=")
        action = _action_named(parser, name) if token.startswith("--") else None
        if isinstance(action, argparse._StoreAction) and action.nargs is None:
            values.setdefault(action, []).append(value if eq else (argv[i + 1] if i + 1 < len(argv) else ""))
    return [f"{action.option_strings[-1]} ({', '.join(map(repr, given))})" for action, given in values.items()
            if len(set(given)) > 1]


def _action_named(parser: argparse.ArgumentParser, name: str) -> argparse.Action | None:
    """The option `name` stands for, as argparse reads it: whole, or a prefix of one option only."""
    actions = parser._option_string_actions
    if name in actions:
        return actions[name]
    if not parser.allow_abbrev:
        return None
    matches = {actions[s] for s in actions if s.startswith(name)}
    return matches.pop() if len(matches) == 1 else None


def option_strings(parser: argparse.ArgumentParser) -> list[str]:
    return [s for action in parser._actions for s in action.option_strings if s.startswith("--")]


def unknown_arguments(args: list[str], known: list[str]) -> list[str]:
    """A line per argument nobody knows, with the nearest known option; a plain word right after
    an unknown option is taken for its value."""
    problems = []
    previous_unknown_option = False
    for arg in args:
        if arg.startswith("-"):
            name = arg.split("=", 1)[0]
            nearest = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
            problems.append(f"{name}" + (f" (did you mean {nearest[0]}?)" if nearest else ""))
            previous_unknown_option = "=" not in arg
        elif previous_unknown_option:
            previous_unknown_option = False
        else:
            problems.append(f"{arg!r} (not an option)")
    return problems
