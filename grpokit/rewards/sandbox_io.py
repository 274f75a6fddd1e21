"""The parent's side of one sandboxed run: feed its input pipes, read its outputs and answers under a deadline,
and make sure every process of it is gone (``reap``), with the kernel's CPU and memory counts as evidence."""

from __future__ import annotations

import json
import os
import resource
import select
import selectors
import signal
import time

from grpokit.rewards.sandbox_result import SandboxLimits, SandboxResult, classify, parse_report

REAP_WAIT_S = 5.0  # how long bwrap gets to reap the sandbox's init after the kill


class Collector:
    """Feeds the child's input pipes, reads its outputs under a deadline, then makes sure it is all gone."""

    def __init__(self, proc, limits: SandboxLimits, deadline: float, rep_r: int, status_r: int | None) -> None:
        self.proc, self.limits, self.status_r, self.rep_r = proc, limits, status_r, rep_r
        self.deadline = deadline
        self.bufs = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}
        self.stdin_fd = proc.stdin.fileno()
        # ru_maxrss of a child counts the memory of the trainer it was started from: evidence only above that
        self.parent_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        self.partial = bytearray()  # the report line being received
        self.report_bytes = 0
        self.notes: list[dict] = []  # the harness's reports other than answers (exceptions, fatal, blocked)
        self.ready = self.program_failed = self.done = False
        self.child_pid: int | None = None  # the sandbox's init on the host (bwrap mode), for its peak memory
        self.peak = 0
        self.await_q: int | None = None
        self.answer: dict | None = None
        self.status = bytearray()
        self.timed_out = self.too_much = False
        self.pidfd: int | None = None
        self.bwrap_fd = os.pidfd_open(proc.pid)
        self.rusage = None
        self.sel = selectors.DefaultSelector()
        self.reading = {*self.bufs, rep_r} | ({status_r} if status_r is not None else set())
        for fd in self.reading:
            self.sel.register(fd, selectors.EVENT_READ)
        self.pending: dict[int, memoryview] = {}
        self.close_after: set[int] = set()
        self.writers: set[int] = set()  # the input pipes this collector owns (closed by reap at the latest)

    def alive(self) -> bool:
        return bool(self.reading) and not (self.timed_out or self.too_much)

    def send(self, fd: int, data: bytes, close: bool = False) -> None:
        """Queue ``data`` for the writer ``fd`` (then close it when ``close``); ``pump`` writes it."""
        if fd in self.pending:
            self.pending[fd] = memoryview(bytes(self.pending[fd]) + data)
        elif fd in self.writers:
            self.pending[fd] = memoryview(data)
            self.sel.register(fd, selectors.EVENT_WRITE)
        if close:
            self.close_writer_after(fd)

    def adopt_writer(self, fd: int) -> None:
        os.set_blocking(fd, False)
        self.writers.add(fd)

    def close_writer_after(self, fd: int) -> None:
        """Close ``fd`` once what is queued for it is written (at once when nothing is)."""
        self.close_after.add(fd)
        if fd not in self.pending:
            self._close_writer(fd)

    def _close_writer(self, fd: int) -> None:
        if fd not in self.writers:
            return
        self.writers.discard(fd)
        if fd == self.stdin_fd:
            self.proc.stdin.close()
        else:
            os.close(fd)

    def pump(self, stop) -> None:
        """Until ``stop()``, the deadline, too much output, or every output at EOF and the child gone: bwrap's
        status pipe closes only when bwrap exits (the sandboxed program never holds it), so a program that
        closes its outputs and keeps running is still waited for, and then counts as a timeout."""
        while self.reading and not stop() and not (self.timed_out or self.too_much):
            remaining = self.deadline - time.monotonic()
            if remaining <= 0:
                self.timed_out = True
                return
            for key, _ in self.sel.select(timeout=remaining):
                fd = key.fd
                if fd in self.pending:
                    if not self._write(fd):
                        self.sel.unregister(fd)
                    continue
                chunk = os.read(fd, 65536)
                if fd == self.status_r:
                    self.status += chunk
                    self._watch_child()
                if not chunk:
                    self.sel.unregister(fd)
                    self.reading.discard(fd)
                    if fd == self.rep_r:
                        self.program_failed = self.program_failed or not self.ready
                    continue
                if fd == self.rep_r:
                    self._reports(chunk)
                elif fd != self.status_r:
                    self.bufs[fd] += chunk
                    if len(self.bufs[fd]) > self.limits.max_output_bytes:
                        self.too_much = True
                if self.too_much:
                    return
        if not self.reading and self.status_r is None:  # no status pipe (no bwrap): wait for the exit
            self._wait_exit(max(0.0, self.deadline - time.monotonic()))

    def _reports(self, chunk: bytes) -> None:
        self.report_bytes += len(chunk)
        if self.report_bytes > self.limits.max_report_bytes:
            self.too_much = True
            return
        self.partial += chunk
        while True:
            nl = self.partial.find(b"\n")
            if nl < 0:
                if len(self.partial) > self.limits.max_output_bytes:
                    self.too_much = True
                return
            line = bytes(self.partial[:nl])
            del self.partial[: nl + 1]
            self._line(parse_report(line))

    def _line(self, doc) -> None:
        if not isinstance(doc, dict):
            return
        if self.await_q is not None and doc.get("q") == self.await_q and self.answer is None:
            self.answer = doc
        elif doc.get("ready") is True and not self.program_failed:
            self.ready = True
        elif doc.get("done") is True:
            self.done = True  # (a forged one only makes the parent look at the peak early)
        elif "exception" in doc or "fatal" in doc or "blocked" in doc:
            if len(self.notes) < 64:
                self.notes.append(doc)
            if "exception" in doc and not self.ready:
                self.program_failed = True

    def _write(self, fd: int) -> bool:
        """Write what the pipe takes; False (and the pipe closed if asked) when done or the reader is gone."""
        try:
            n = os.write(fd, self.pending[fd][:65536])
            self.pending[fd] = self.pending[fd][n:]
        except (BrokenPipeError, BlockingIOError) as exc:
            if isinstance(exc, BlockingIOError):
                return True
            self.pending[fd] = memoryview(b"")
        if len(self.pending[fd]):
            return True
        del self.pending[fd]
        if fd in self.close_after:
            self._close_writer(fd)
        return False

    def _watch_child(self) -> None:
        """Hold a pidfd on the sandbox's init (from bwrap's status line) so it can be killed without pid reuse."""
        if self.pidfd is not None:
            return
        docs = _json_docs(bytes(self.status))
        if any("exit-code" in d for d in docs):
            return  # already over: bwrap reaped it
        for doc in docs:
            if "child-pid" in doc:
                try:
                    self.pidfd = os.pidfd_open(int(doc["child-pid"]))
                    self.child_pid = int(doc["child-pid"])
                except (OSError, ValueError):
                    pass

    def read_peak(self) -> None:
        """The child's peak resident memory (VmHWM) as the kernel reports it in /proc, while it is alive: evidence
        for the ``memory`` status that the program cannot write (its own reports could say anything)."""
        pid, fd = (self.child_pid, self.pidfd) if self.status_r is not None else (self.proc.pid, self.bwrap_fd)
        if pid is None or fd is None:
            return
        try:
            with open(f"/proc/{pid}/status", "rb") as f:
                hwm = next((int(line.split()[1]) for line in f if line.startswith(b"VmHWM:")), 0) * 1024
        except (OSError, ValueError, IndexError):
            return
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        if not poller.poll(0):  # still alive after the read: the pid was not reused, the number is its own
            self.peak = max(self.peak, hwm)

    def _wait_exit(self, timeout: float) -> bool:
        """Wait (without reaping) until the child has exited; False when it is still running."""
        poller = select.poll()
        poller.register(self.bwrap_fd, select.POLLIN)
        done = bool(poller.poll(int(timeout * 1000)))
        if not done:
            self.timed_out = True
        return done

    def reap(self) -> None:
        """Kill the sandbox's init (its whole PID namespace dies with it) and let bwrap reap it: killing bwrap
        first would leave the init to the host's pid 1, which in a container may never reap it. The child is
        reaped with ``wait4``, whose CPU time and peak memory (the child's and those it reaped) are the
        evidence ``classify`` goes by."""
        self.sel.close()
        for fd in list(self.writers):
            self._close_writer(fd)
        if self.pidfd is not None:
            try:
                signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
            except ProcessLookupError:
                pass
        poller = select.poll()
        poller.register(self.bwrap_fd, select.POLLIN)
        if not poller.poll(int(REAP_WAIT_S * 1000) if self.pidfd is not None else 0):
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)  # not reaped yet, so the group id is still ours
            except (ProcessLookupError, PermissionError):
                pass
        _, status, self.rusage = os.wait4(self.proc.pid, 0)
        self.proc.returncode = os.waitstatus_to_exitcode(status)
        os.close(self.bwrap_fd)
        if self.proc.stdin and not self.proc.stdin.closed:
            self.proc.stdin.close()
        self.proc.stdout.close()
        self.proc.stderr.close()
        if self.pidfd is not None:  # the init of a PID namespace exits only after all its other processes
            poller = select.poll()
            poller.register(self.pidfd, select.POLLIN)
            poller.poll(int(REAP_WAIT_S * 1000))
            os.close(self.pidfd)
        if self.status_r is not None:
            os.close(self.status_r)
        os.close(self.rep_r)

    def result(self) -> SandboxResult:
        out, err = (bytes(b) for b in self.bufs.values())
        ru = self.rusage
        cpu = ru.ru_utime + ru.ru_stime if ru is not None else 0.0
        peak = ru.ru_maxrss * 1024 if ru is not None and ru.ru_maxrss * 1024 > self.parent_peak else 0
        peak = max(peak, self.peak)
        return classify(self.proc.returncode, out, err, self.notes, self.timed_out, self.too_much, cpu, peak,
                        self.limits)  # fmt: skip


def _json_docs(data: bytes) -> list[dict]:
    docs, dec, text, i = [], json.JSONDecoder(), data.decode("utf-8", "replace"), 0
    while True:
        while i < len(text) and text[i].isspace():
            i += 1
        if i >= len(text):
            return docs
        try:
            doc, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            return docs
        if isinstance(doc, dict):
            docs.append(doc)
