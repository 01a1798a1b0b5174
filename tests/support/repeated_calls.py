"""Calls made over and over from background threads while a test does something to the fleet (kills a
process, freezes etcd), keeping every answer and every gRPC error code for the test to assert on."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import grpc


class RepeatedCalls:
    """`call(i)` from `threads` threads until the block exits; thread t passes i = t, t + threads, ...
    (so the threads spread over whatever `i` indexes). Answers and error codes are appended as they come."""

    def __init__(self, call: Callable[[int], Any], threads: int = 1) -> None:
        self.call, self.stop = call, threading.Event()
        self.answers: list[Any] = []
        self.errors: list[grpc.StatusCode] = []
        self.threads = [threading.Thread(target=self._run, args=(t, threads)) for t in range(threads)]

    def _run(self, i: int, step: int) -> None:
        while not self.stop.is_set():
            try:
                self.answers.append(self.call(i))
            except grpc.RpcError as exc:
                self.errors.append(exc.code())
            i += step

    def __enter__(self) -> RepeatedCalls:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join()
