"""InputBatch on the CPU: a padded (CUDA-graph) step's buffers hold that step's values while
its device views are made once and reused."""

from __future__ import annotations

import dataclasses

import torch
from factories import decode_step

from gptoss_serve.engine.block_pool import BLOCK_SIZE
from gptoss_serve.engine.input_batch import InputBatch
from gptoss_serve.engine.scheduler_output import ScheduledRequest

MAX_MODEL_LEN = 1024


def _batch() -> InputBatch:
    return InputBatch(
        max_num_tokens=64, max_num_seqs=8, max_model_len=MAX_MODEL_LEN, num_groups=2,
        device=torch.device("cpu"),
    )  # fmt: skip


def _new_prefill() -> ScheduledRequest:
    """A just-admitted 20-token prompt in blocks 500 and 501 of both groups."""
    return ScheduledRequest(
        request_id="p", token_ids=tuple(range(20)), num_computed_tokens=0,
        block_ids=((500, 501),) * 2, new_block_ids=((500, 501),) * 2, is_new=True,
        is_sampled=True,
    )  # fmt: skip


def test_a_padded_step_reuses_its_views_and_writes_its_values() -> None:
    batch = _batch()
    first = batch.prepare(decode_step(1, [40, 70, 5]), decode_rows=4)
    second = batch.prepare(decode_step(2, [41, 71, 6]), decode_rows=4)
    assert second.metadata is first.metadata and second.input_ids is first.input_ids
    assert second.sampled_request_ids == ("r0", "r1", "r2")
    meta = second.metadata
    assert second.input_ids.tolist() == [14, 15, 16, 0]  # padding row: token 0
    assert meta.num_decodes == 4 and meta.decode_max_seq_len == MAX_MODEL_LEN
    assert meta.positions.tolist() == [41, 71, 6, 0]
    assert meta.decode_seq_lens.tolist() == [42, 72, 7, 0]  # padding row: length 0
    for group in range(2):
        slots = meta.slot_mapping[group].tolist()
        # position p of request i: block 100·i + p // BLOCK_SIZE, offset p % BLOCK_SIZE
        assert slots == [2 * BLOCK_SIZE + 41 % BLOCK_SIZE, 104 * BLOCK_SIZE + 71 % BLOCK_SIZE,
                         200 * BLOCK_SIZE + 6, -1]  # fmt: skip
        table = meta.decode_block_tables[group]
        assert table.shape == (4, MAX_MODEL_LEN // BLOCK_SIZE)
        assert table[1, :5].tolist() == [100, 101, 102, 103, 104]
    assert meta.prefill_block_tables[0].shape == (0, 1)
    assert meta.prefill_query_start_loc.tolist() == [0]


def test_padded_and_unpadded_steps_agree_on_the_real_rows() -> None:
    step = decode_step(3, [33, 17])
    padded = _batch().prepare(step, decode_rows=2).metadata
    plain = _batch().prepare(step).metadata
    assert torch.equal(padded.positions, plain.positions)
    assert torch.equal(padded.decode_seq_lens, plain.decode_seq_lens)
    for group in range(2):
        assert torch.equal(padded.slot_mapping[group], plain.slot_mapping[group])
        width = plain.decode_block_tables[group].shape[1]
        assert torch.equal(padded.decode_block_tables[group][:, :width],
                           plain.decode_block_tables[group])  # fmt: skip


def test_a_step_counts_its_real_rows_in_the_lengths_upload() -> None:
    """valid_rows (int32 [1] on the device) holds a padded step's real decode rows, an
    unpadded step's rows, each step's own (one persistent tensor, which a graph reads at
    every replay); it lives in the lengths' buffer, so the step's one copy of the lengths
    uploads it."""
    batch = _batch()
    padded = batch.prepare(decode_step(1, [40, 70, 5]), decode_rows=8)
    assert padded.valid_rows.dtype == torch.int32 and padded.valid_rows.tolist() == [3]
    assert padded.input_ids.shape == (8,)
    assert batch.prepare(decode_step(2, [41, 71, 6, 9, 30]), decode_rows=8).valid_rows is (
        padded.valid_rows
    )
    assert padded.valid_rows.tolist() == [5]
    decodes = decode_step(3, [42, 72])
    prefill = _new_prefill()
    mixed = dataclasses.replace(decodes, scheduled=(*decodes.scheduled, prefill))
    assert batch.prepare(mixed).valid_rows.tolist() == [22]  # not padded: every row
    capture = batch.prepare(decode_step(4, []), decode_rows=4)  # a graph's capture: padding
    assert capture.valid_rows.tolist() == [0]
    lengths = padded.metadata.decode_seq_lens
    assert padded.valid_rows.untyped_storage().data_ptr() == lengths.untyped_storage().data_ptr()


def test_a_row_is_rewritten_when_its_tables_change_and_only_then() -> None:
    """The host tables skip a row that already holds the very tuple of this step (a request's
    tables are one object until they change), and write it whenever it is another one: the
    same request's grown table, or another request in that row."""
    batch = _batch()
    step = decode_step(1, [40, 70])
    batch.prepare(step, decode_rows=2)
    host = batch.decode_tables[0].np
    host[0, 0] = -7  # what a skipped row keeps (never happens to a real row)
    batch.prepare(dataclasses.replace(step, step=2), decode_rows=2)
    assert host[0, 0] == -7  # the same tuple: not written again
    grown = dataclasses.replace(
        step.scheduled[0], block_ids=(tuple(range(0, 4)),) * 2, num_computed_tokens=48
    )
    other = decode_step(3, [70, 40]).scheduled  # the rows' requests swapped
    meta = batch.prepare(
        dataclasses.replace(step, step=3, scheduled=(grown, other[1])), decode_rows=2
    ).metadata
    assert meta.decode_block_tables[0][0, :4].tolist() == [0, 1, 2, 3]
    meta = batch.prepare(dataclasses.replace(step, step=4, scheduled=other), decode_rows=2).metadata
    assert meta.decode_block_tables[0][0, :5].tolist() == [0, 1, 2, 3, 4]
    assert meta.decode_block_tables[1][1, :3].tolist() == [100, 101, 102]


def test_a_step_uploads_its_rows_at_its_own_width_only() -> None:
    """A graph step's tables land in the leading rows and the step's width (rounded up to 16
    blocks) of the full-width buffer the graph reads: the padding rows and the columns past
    that width are not copied (at 1024 rows of 128k tables the full rows were 67 MB a step).
    An unpadded step's tables are one contiguous array of that width."""
    batch = _batch()
    for table in batch.decode_tables:
        table.wide.fill_(-5)
    meta = batch.prepare(decode_step(1, [40, 300]), decode_rows=4).metadata
    for group in range(2):
        wide = meta.decode_block_tables[group]
        assert wide.shape == (4, MAX_MODEL_LEN // BLOCK_SIZE)
        assert wide[1, :19].tolist() == list(range(100, 119))  # 301 tokens: 19 blocks
        assert (wide[:2, 32:] == -5).all() and (wide[2:] == -5).all()
    plain = batch.prepare(decode_step(2, [41, 301])).metadata
    for group in range(2):
        table = plain.decode_block_tables[group]
        assert table.is_contiguous() and table.shape == (2, 32)
        assert table[1, :19].tolist() == list(range(100, 119))
        assert table[0, :3].tolist() == [0, 1, 2]


def test_a_step_uploads_the_leading_rows_of_its_fields_only() -> None:
    """Tokens, positions, slots and lengths go up for the step's own rows (a padded step's
    padding included), not the buffers' whole length (5 x 8192 int64 at the defaults, ~13 µs
    of device time between two decode steps): entries past them keep an earlier step's."""
    batch = _batch()
    prefill = batch.prepare(dataclasses.replace(
        decode_step(1, []), scheduled=(_new_prefill(),), num_decodes=0))  # fmt: skip
    assert prefill.metadata.positions.tolist() == list(range(20))
    for name in ("input_ids", "positions"):  # device entries no step of 4 rows may touch
        batch.rows.view(name, 20)[4:] = -9
    batch.lens.view("prefill_seq_lens", 8)[5:] = -9
    step = batch.prepare(decode_step(2, [40, 70]), decode_rows=4)
    assert step.metadata.positions.tolist() == [40, 70, 0, 0]
    assert step.input_ids.tolist() == [14, 15, 0, 0]
    assert step.metadata.decode_seq_lens.tolist() == [41, 71, 0, 0]
    assert step.valid_rows.tolist() == [2]
    for name in ("input_ids", "positions"):
        assert (batch.rows.view(name, 20)[4:] == -9).all()
    assert (batch.lens.view("prefill_seq_lens", 8)[5:] == -9).all()
    again = batch.prepare(decode_step(3, [41, 71]))
    assert again.metadata.positions.tolist() == [41, 71]
    assert again.metadata.decode_seq_lens.tolist() == [42, 72]


def test_a_mixed_step_between_graph_steps_leaves_the_graphs_tables_whole() -> None:
    """Unpadded steps (prefills with decodes) upload into their own device array, so the
    next graph step still reads every row it needs, a row that grew past the last width
    included."""
    batch = _batch()
    batch.prepare(decode_step(1, [40, 70]), decode_rows=2)
    decodes = decode_step(2, [41, 71])
    prefill = _new_prefill()
    mixed = batch.prepare(dataclasses.replace(decodes, scheduled=(*decodes.scheduled, prefill)))
    assert mixed.metadata.prefill_block_tables[0][0, :2].tolist() == [500, 501]
    longer = decode_step(3, [42, 600])  # 601 tokens: 38 blocks, past the 16 uploaded before
    meta = batch.prepare(longer, decode_rows=2).metadata
    for group in range(2):
        assert meta.decode_block_tables[group][0, :3].tolist() == [0, 1, 2]
        assert meta.decode_block_tables[group][1, :38].tolist() == list(range(100, 138))
