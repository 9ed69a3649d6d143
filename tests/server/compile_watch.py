"""`python -m tests.server.compile_watch serve ...`: `pagedserve serve ...` that appends a
line to the file named by $COMPILE_WATCH_LOG whenever something starts to compile.

What it records, each as a line `<kind> <what>`:
- `dynamo`: Dynamo starts to trace a frame (every `torch.compile`, Inductor's or another
  backend's, starts here; a recompile too), through Dynamo's compile-start callbacks, or
  captures a whole graph ahead of time (`aot_compile`, which runs no callbacks);
- `triton`: Triton's JIT compiles a kernel that this process has not compiled yet;
- `subprocess`: a C or C++ compiler, a linker, ninja, nvcc or ptxas is started (Inductor's
  C++ code, a `torch.utils.cpp_extension` build, Triton's launcher and PTX), or Inductor's
  pool of compile workers.

The server starts with a first line `watching`, so a test can tell the hooks are in.
"""

from __future__ import annotations

import os
import re
import runpy
import shlex
import subprocess
import sys
import threading
from typing import Any

LOG_VARIABLE = "COMPILE_WATCH_LOG"  # not PAGEDSERVE_: the server refuses unknown ones
_COMPILERS = re.compile(
    r"([\w.]+-)*(cc|c\+\+|gcc|g\+\+|clang|clang\+\+|ld|ld\.\w+|ninja|nvcc|ptxas|icpx|icx)(-[\d.]+)?"
)
_lock = threading.Lock()


def record(kind: str, what: str) -> None:
    line = " ".join(f"{kind} {what}".split())  # one line, whatever `what` holds
    with _lock, open(os.environ[LOG_VARIABLE], "a") as log:
        log.write(line[:500] + "\n")


def _argv(args: Any) -> list[str]:
    if isinstance(args, str | bytes | os.PathLike):
        text = os.fsdecode(args)
        try:
            return shlex.split(text)
        except ValueError:
            return text.split()
    return [
        os.fsdecode(arg) if isinstance(arg, str | bytes | os.PathLike) else str(arg) for arg in args
    ]


def _compiles(argv: list[str]) -> bool:
    if any("compile_worker" in arg for arg in argv):
        return True  # Inductor's pool of compile workers
    # The program, or the one a shell (`sh -c "g++ ..."`) or ccache runs: by its name.
    programs = [arg.split()[0] for arg in argv[:3] if arg.strip()]
    return any(_COMPILERS.fullmatch(os.path.basename(program)) for program in programs)


def _watch_subprocesses() -> None:
    popen_init = subprocess.Popen.__init__

    def init(self: subprocess.Popen, *args: Any, **options: Any) -> None:
        try:
            argv = _argv(args[0] if args else options.get("args", ()))
        except TypeError:
            argv = []  # Popen itself says what is wrong with them
        if _compiles(argv):
            record("subprocess", " ".join(argv))
        popen_init(self, *args, **options)

    subprocess.Popen.__init__ = init  # type: ignore[method-assign]


def _watch_dynamo() -> None:
    import torch._dynamo
    from torch._dynamo import convert_frame

    torch._dynamo.callback_handler.register_start_callback(
        lambda args: record("dynamo", f"{args.callback_trigger.name} compile {args.compile_id}")
    )
    # Ahead-of-time compiles (`torch.compile(...).aot_compile`, the compiled forward's)
    # capture their graph here, without the callbacks.
    capture = convert_frame.fullgraph_capture

    def fullgraph_capture(mod: Any, *args: Any, **kwargs: Any) -> Any:
        record("dynamo", f"fullgraph_capture {getattr(mod, '__qualname__', type(mod).__name__)}")
        return capture(mod, *args, **kwargs)

    convert_frame.fullgraph_capture = fullgraph_capture


def _watch_triton() -> None:
    try:
        from triton import knobs
    except ImportError:
        return

    def before_compile(*args: Any, **kwargs: Any) -> bool:
        record("triton", str(kwargs.get("repr", kwargs.get("key", ""))))
        return False  # compile as usual

    knobs.runtime.jit_cache_hook = before_compile


def main() -> None:
    _watch_subprocesses()
    _watch_dynamo()
    _watch_triton()
    record("watching", f"pid {os.getpid()}")
    sys.argv = ["pagedserve", *sys.argv[1:]]
    runpy.run_module("pagedserve", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
