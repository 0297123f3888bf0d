"""Pieces of streamed text, and the engine loop's bounded waiting queue, without a model."""

from __future__ import annotations

import asyncio

import pytest

from phalanx.serve.detokenize import IncrementalText
from phalanx.serve.engine_loop import EngineLoop, NotAccepting
from phalanx.scheduling.scheduler import QueueFull, Scheduler, Sequence


def _bytes(ids: list[int]) -> str:
    return bytes(ids).decode("utf-8", errors="replace")


def _pieces(text: IncrementalText, ids: list[int]) -> list[str]:
    return [text.add(i) for i in ids] + [text.finish()]


def test_a_character_is_never_split():
    """"a€b" is 1 + 3 + 1 bytes: the euro sign comes out whole, with its last byte."""
    ids = list("a€b".encode())
    assert _pieces(IncrementalText(_bytes), ids) == ["a", "", "", "€", "b", ""]


def test_invalid_bytes_still_end_up_in_the_text():
    """A lone continuation byte decodes to U+FFFD and stays so: held back until the next
    token, then given out; the pieces always add up to the whole decoding."""
    ids = [0x61, 0x80, 0x62, 0xE2, 0x82]
    pieces = _pieces(IncrementalText(_bytes), ids)
    assert "".join(pieces) == _bytes(ids) == "a\ufffdb\ufffd"


def test_stop_string_is_held_back_and_cut():
    """Stop "END": "xEN" may be its start, so "EN" waits; "D" completes it: the text ends
    before it and the sequence stops."""
    text = IncrementalText(_bytes, ["END"])
    pieces = [text.add(i) for i in b"abxEND"]
    assert "".join(pieces) == "abx" and text.stopped and text.finish() == ""
    other = IncrementalText(_bytes, ["END"])
    assert "".join(_pieces(other, list(b"abENx"))) == "abENx" and not other.stopped


def _loop_over(scheduler: Scheduler, max_waiting: int) -> EngineLoop:
    """An engine loop whose engine is only `scheduler` (nothing is stepped)."""

    class Engine:
        pass

    engine = Engine()
    engine.scheduler = scheduler
    return EngineLoop(lambda: engine, max_waiting=max_waiting, metrics=None, on_load_error=print)


def test_waiting_queue_is_bounded_and_loading_refuses():
    """submit: 503 (NotAccepting) until the model is loaded, then QueueFull (429) once
    `max_waiting` requests wait, before anything reaches the scheduler."""
    scheduler = Scheduler(num_blocks=8, block_size=4, max_num_seqs=1, max_num_batched_tokens=8, max_waiting=8)
    loop = _loop_over(scheduler, max_waiting=2)

    async def submit_all():
        with pytest.raises(NotAccepting):
            loop.submit(Sequence.of("early", [1], 1), IncrementalText(_bytes))
        loop.scheduler = scheduler  # as the engine thread does once the model is loaded
        loop.ready.set()
        for name in "ab":
            loop.submit(Sequence.of(name, [1], 1), IncrementalText(_bytes))
        with pytest.raises(QueueFull):
            loop.submit(Sequence.of("c", [1], 1), IncrementalText(_bytes))
        with pytest.raises(ValueError, match="KV blocks"):
            loop.submit(Sequence.of("huge", [1] * 40, 1), IncrementalText(_bytes))

    asyncio.run(submit_all())


def test_windowed_pieces_add_up_to_decoding_every_id(tmp_path):
    """The pieces decode a window of ids, not all of them: for a byte-level BPE (with its special
    token skipped or kept), words joined by a WordPiece decoder, a SentencePiece-style Metaspace
    decoder (which drops the first token's leading space) and bytes, over random ids including
    invalid byte runs, the pieces always add up to decoding every id at once."""
    import random

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from phalanx.testing.tokenizers import train_bpe

    bpe = Tokenizer.from_file(str(train_bpe(tmp_path / "bpe.json", vocab_size=300, byte_alphabet=True)))
    words = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["w0", "a", "b", "##c", ".", ","])}, unk_token="w0"))
    words.decoder = decoders.WordPiece(prefix="##")
    pieces = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["<unk>", "\u2581hi", "\u2581a", "b", "\u2581"])},
                                        unk_token="<unk>"))
    pieces.pre_tokenizer = pre_tokenizers.Metaspace()
    pieces.decoder = decoders.Metaspace()
    cases = [(lambda ids: bpe.decode(ids, skip_special_tokens=True), bpe.get_vocab_size()),
             (lambda ids: bpe.decode(ids, skip_special_tokens=False), bpe.get_vocab_size()),
             (words.decode, 6), (pieces.decode, 5), (_bytes, 256)]
    rng = random.Random(0)
    for decode, vocab in cases:
        for _ in range(40):
            ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 60))]
            assert "".join(_pieces(IncrementalText(decode), ids)) == decode(ids), (ids, decode(ids))


def test_a_queue_filled_between_submit_and_step_is_429_not_503():
    """Issue 36: an overflowing queue was sometimes answered 503 `server_error`. submit counts
    the loop's own waiting requests; the scheduler can still refuse one at the next step (the
    queue filled meanwhile): that request alone gets 429 `queue_full`, as submit's refusal, and
    the client is told a rate_limit_error, not a server error."""
    from phalanx.serve.api import _piece_error

    scheduler = Scheduler(num_blocks=8, block_size=4, max_num_seqs=1, max_num_batched_tokens=8, max_waiting=1)
    loop = _loop_over(scheduler, max_waiting=4)

    async def race():
        loop.scheduler = scheduler
        loop.ready.set()
        handles = [loop.submit(Sequence.of(name, [1], 1), IncrementalText(_bytes)) for name in "ab"]
        incoming, loop._incoming = loop._incoming, []
        loop._apply(incoming, [], None)  # what the engine thread does before its next step
        await asyncio.sleep(0)
        return handles

    first, second = asyncio.run(race())
    assert first.queue.empty() and not first.done  # the first waits in the scheduler
    piece = second.queue.get_nowait()
    assert (piece.status, piece.code) == (429, "queue_full") and second.done
    error = _piece_error(piece)
    assert error.status == 429 and error.body()["error"]["type"] == "rate_limit_error"
