"""Output processing: a sampled token becomes streamed text, and stop conditions end the request.

A request stops on its max_tokens, on a stop token id, on the model's EOS (unless ignore_eos), or when a
stop string appears in its detokenised output (checked across token boundaries).
"""

from __future__ import annotations

from k3.v1 import common_pb2
from k3core.tokenizer import StreamDecoder, Tokenizer
from services.engine.request import EngineRequest, StepOutput


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None, eos_token_id: int | None):
        """Without a tokenizer (a model whose vocabulary has none here) no text is produced and stop
        strings are refused at validation."""
        self.tokenizer = tokenizer
        self.eos_token_id = eos_token_id
        self._decoders: dict[str, StreamDecoder] = {}
        self._text_tail: dict[str, str] = {}

    def accept(self, req: EngineRequest, token: int) -> StepOutput:
        """Append one generated token to `req` and say what to stream and whether it finished."""
        req.output.append(token)
        decoder = None
        if self.tokenizer is not None:
            decoder = self._decoders.setdefault(req.rid, StreamDecoder(self.tokenizer))
        text = decoder.push(token) if decoder else ""
        reason = self._finish_reason(req, token, text)
        if reason != common_pb2.FINISH_REASON_UNSPECIFIED:
            text += decoder.flush() if decoder else ""
            self.forget(req.rid)
        return StepOutput([token], text, reason)

    def forget(self, rid: str) -> None:
        self._decoders.pop(rid, None)
        self._text_tail.pop(rid, None)

    def _finish_reason(self, req: EngineRequest, token: int, text: str) -> int:
        opts = req.options
        if token in opts.stop_token_ids or (token == self.eos_token_id and not opts.ignore_eos):
            return common_pb2.FINISH_REASON_STOP
        if opts.stop:
            window = self._text_tail.get(req.rid, "") + text
            if any(stop in window for stop in opts.stop):
                return common_pb2.FINISH_REASON_STOP
            keep = max(len(s) for s in opts.stop) - 1
            self._text_tail[req.rid] = window[-keep:] if keep else ""
        if len(req.output) >= opts.max_tokens:
            return common_pb2.FINISH_REASON_LENGTH
        return common_pb2.FINISH_REASON_UNSPECIFIED
