"""An engine stand-in for the serving layer's tests: every running request gets one token a
step, max_tokens ends it."""

from __future__ import annotations

from app.engine.request import Request, RequestDelta


class StepEngine:
    """Engine stand-in: each step gives every running request one token; max_tokens ends it."""

    def __init__(self):
        self.running: dict[str, list] = {}
        self.aborted: list[str] = []
        self.steps = 0

    def add_request(self, request: Request) -> None:
        self.running[request.request_id] = [request, 0]

    def abort(self, request_id: str) -> None:
        if self.running.pop(request_id, None) is not None:
            self.aborted.append(request_id)

    def has_unfinished(self) -> bool:
        return bool(self.running)

    def wake(self) -> None:
        pass  # its steps never idle-wait

    def step(self) -> list[RequestDelta]:
        self.steps += 1
        out = []
        for rid, state in list(self.running.items()):
            state[1] += 1
            n = state[1]
            done = n >= state[0].sampling_params.max_tokens
            out.append(RequestDelta(rid, 0, [n], f"t{n} ", done, "length" if done else None))
            if done:
                del self.running[rid]
        return out
