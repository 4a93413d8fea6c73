"""Grammar compiles in child processes, each bounded in time: a compile past its bound is killed
with its process (CPython cannot stop a thread inside xgrammar's C++), which is then replaced.

A short regex in a JSON schema's ``pattern`` can make xgrammar build an automaton for minutes; run
on the worker's own threads, it held a core and the GIL-free compile could not be cancelled. Here it
costs one child process at most ``compile_timeout_s`` and the request gets GrammarTooComplex.

This module imports xgrammar and nothing of the engine: it is what a compile child runs (``python -m``)."""

import os
import queue
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection

import xgrammar as xgr

from shared.config import GrammarBounds
from shared.errors import GrammarCompilesBusy, GrammarTooComplex, InvalidSchema
from shared.schemas import StructuredOutput

_ANY_OBJECT = '{"type": "object"}'
_START_TIMEOUT_S = 120.0  # a child imports xgrammar (and torch with it) before its first compile


def _compile(compiler: xgr.GrammarCompiler, kind: str, text: str | None) -> xgr.CompiledGrammar:
    # compact JSON: a small model cannot wander off into unbounded whitespace
    if kind == "structural_tag":  # tool calls (services/worker/tool_grammar.py)
        assert text is not None
        return compiler.compile_structural_tag(text)
    if text is None:  # JSON mode: any object
        return compiler.compile_json_schema(_ANY_OBJECT, any_whitespace=False, strict_mode=False)
    return compiler.compile_json_schema(text, any_whitespace=False)


def _serve(requests: Connection, replies: Connection) -> None:
    """A child's loop: the tokenizer info, then (kind, text) in, ("ok", compiled grammar JSON) or
    ("error", reason) out."""
    threading.Thread(target=_exit_with, args=(os.getppid(),), name="parent-watch", daemon=True).start()
    info = xgr.TokenizerInfo.deserialize_json(requests.recv())
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    replies.send(("ready", ""))
    while True:
        try:
            kind, text = requests.recv()
        except EOFError:  # the parent is gone
            return
        try:
            replies.send(("ok", _compile(compiler, kind, text).serialize_json()))
        except (RuntimeError, ValueError) as e:
            replies.send(("error", _reason(e)))


def _exit_with(parent: int) -> None:
    """A worker that dies mid-compile leaves no child burning a core until xgrammar returns."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


def _reason(error: Exception) -> str:
    """xgrammar's message without its C++ source location prefix."""
    text = str(error).strip()
    return text.split(": ", 1)[1] if text.startswith("[") and ": " in text else text


class _Child:
    """One compile process and its two pipes; started with the pool and again after each kill.

    A plain ``python -m`` child, not multiprocessing's spawn: spawn re-imports the parent's main module
    (the whole worker, torch included) in every child; this one imports xgrammar only."""

    def __init__(self, tokenizer_info: str):
        self._tokenizer_info = tokenizer_info
        self._process: subprocess.Popen[bytes] | None = None
        self._requests: Connection | None = None
        self._replies: Connection | None = None
        self._ready = False

    def start(self) -> None:
        child_reads, parent_writes = os.pipe()
        parent_reads, child_writes = os.pipe()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(path for path in sys.path if path)}
        self._process = subprocess.Popen(
            [sys.executable, "-m", __name__, str(child_reads), str(child_writes)],
            pass_fds=(child_reads, child_writes),
            stdin=subprocess.DEVNULL,
            env=env,
        )
        os.close(child_reads)
        os.close(child_writes)
        self._requests, self._replies = Connection(parent_writes), Connection(parent_reads)
        self._ready = False

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def run(self, kind: str, text: str | None, timeout_s: float) -> tuple[str, str]:
        """("ok", grammar JSON) or ("error", reason); ("timeout", "") after ``timeout_s`` (the child is
        killed and a new one started); ("crash", "") when the child died on it."""
        if self._process is None or self._process.poll() is not None:
            self.restart()
        assert self._requests is not None and self._replies is not None
        try:
            if not self._ready:  # its start is not part of the compile's time bound
                self._requests.send(self._tokenizer_info)
                if not self._replies.poll(_START_TIMEOUT_S):
                    raise EOFError("the compile process did not start")
                self._replies.recv()
                self._ready = True
            self._requests.send((kind, text))
            if not self._replies.poll(timeout_s):
                self.restart()
                return "timeout", ""
            status, payload = self._replies.recv()
            return status, payload
        except (EOFError, OSError):
            self.restart()
            return "crash", ""

    def restart(self) -> None:
        self.kill()
        self.start()

    def kill(self) -> None:
        if self._process is not None:
            self._process.kill()
            self._process.wait(timeout=10)
        for conn in (self._requests, self._replies):
            if conn is not None:
                conn.close()
        self._process, self._requests, self._replies, self._ready = None, None, None, False


class CompilePool:
    """``bounds.compile_processes`` compile children; a compile waits for a free one, runs at most
    ``bounds.compile_timeout_s``, and comes back as a CompiledGrammar of this process."""

    def __init__(self, tokenizer_info: xgr.TokenizerInfo, bounds: GrammarBounds):
        self._info = tokenizer_info
        self._bounds = bounds
        serialized = tokenizer_info.serialize_json()
        self._children = [_Child(serialized) for _ in range(bounds.compile_processes)]
        self._idle: queue.SimpleQueue[_Child] = queue.SimpleQueue()
        for child in self._children:
            child.start()  # all boot side by side, before the first compile needs them
            self._idle.put(child)
        self._closed = threading.Event()

    def compile(self, spec: StructuredOutput, queued_at: float | None = None) -> xgr.CompiledGrammar:
        """Blocks; raises InvalidSchema (xgrammar refuses it), GrammarTooComplex (past the time bound, or it
        crashed the compiler) or GrammarCompilesBusy (no child was free within the bound of
        ``queued_at``, a time.monotonic() of when the caller began to wait)."""
        started = time.monotonic() if queued_at is None else queued_at
        wait = self._bounds.compile_timeout_s - (time.monotonic() - started)
        try:
            child = self._idle.get(timeout=max(wait, 0.0))
        except queue.Empty:
            raise GrammarCompilesBusy(
                "every grammar compiler is busy: retry shortly", retry_after_s=self._bounds.compile_timeout_s
            ) from None
        try:
            if self._closed.is_set():
                raise GrammarCompilesBusy("the worker is shutting down")
            text = spec.structural_tag if spec.kind == "structural_tag" else spec.json_schema
            status, payload = child.run(spec.kind, text, self._bounds.compile_timeout_s)
        finally:
            self._idle.put(child)
        what, param = ("tools", "tools") if spec.kind == "structural_tag" else ("JSON schema", "response_format")
        if status == "ok":
            return xgr.CompiledGrammar.deserialize_json(payload, self._info)
        if status == "error":
            raise InvalidSchema(f"the {what} cannot be enforced: {payload}", param=param)
        cause = "crashed the grammar compiler" if status == "crash" else "takes too long to compile"
        raise GrammarTooComplex(
            f"the {what} {cause} (bound: {self._bounds.compile_timeout_s:g} s): simplify it, e.g. its "
            "regex patterns and nested repetition counts",
            param=param,
        )

    def pids(self) -> list[int]:
        """The live children's process ids (for tests and operators)."""
        return [pid for child in self._children if (pid := child.pid) is not None]

    def close(self) -> None:
        self._closed.set()
        for child in self._children:
            child.kill()


if __name__ == "__main__":
    _serve(Connection(int(sys.argv[1])), Connection(int(sys.argv[2])))
