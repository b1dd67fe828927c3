"""One step's model inputs in persistent buffers: token ids, positions, K/V slots and block
tables, filled on the host (pinned numpy views) and copied to the device in a few transfers.

The device buffers never move, so a CUDA graph captured over their leading rows reads each
step's values; padded decode rows get length 0 and slot -1 (the kernels skip them), and the
step's count of real rows (``StepInputs.valid_rows``) tells the MoE to leave them out.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from gptoss_serve.engine.attention_metadata import AttentionMetadata
from gptoss_serve.engine.block_pool import BLOCK_SIZE
from gptoss_serve.engine.kv_manager import cdiv
from gptoss_serve.engine.scheduler_output import SchedulerOutput

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepInputs:
    input_ids: torch.Tensor  # [T] int64 on the device
    metadata: AttentionMetadata
    logits_indices: torch.Tensor  # [S] int64: the rows whose next token is sampled
    sampled_request_ids: tuple[str, ...]  # the request of each logits row
    # [1] int32 on the device: rows [0, valid_rows[0]) are the step's own, the rest padding
    # (a graph-sized decode step); the MoE reads it on the device (kernels/moe.py).
    valid_rows: torch.Tensor


class _Buffer:
    """A pinned host array and its device twin, both of the largest shape a step needs."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
        pin = device.type == "cuda"
        self.host = torch.zeros(shape, dtype=dtype, pin_memory=pin)
        self.np = self.host.numpy()
        self.device = torch.zeros(shape, dtype=dtype, device=device)


def _upload_packed(staging: torch.Tensor, packed: torch.Tensor, source: np.ndarray) -> torch.Tensor:
    """``source`` (a host array, maybe strided) in the leading elements of ``packed`` (device,
    1-D), shaped like it: copied contiguous into the leading elements of ``staging`` (pinned,
    1-D) and sent in one copy."""
    size = source.size
    staged = staging[:size].view(source.shape)
    np.copyto(staged.numpy(), source)
    out = packed[:size].view(source.shape)
    out.copy_(staged, non_blocking=True)
    return out


class _Tables:
    """One KV group's block tables, a row per request of the step.

    The host rows (``np``, pinned) are rewritten only when a request's tables change
    (``fill``). What a step reads of them goes up in one contiguous copy: its rows, its width
    in blocks rounded up to 16, packed in a pinned staging array and landing packed on the
    device (``upload``: the step's tables, row stride that width). A CUDA graph reads the
    tables at a fixed address and at their full width (``max_model_len / 16`` blocks, 32 KB a
    row at 128k), so ``upload_wide`` then copies the packed rows into ``wide`` on the device:
    uploading the full rows instead cost 67 MB of host-to-device copy a step at 1024 rows.
    """

    def __init__(self, rows: int, width: int, device: torch.device, *, wide: bool) -> None:
        pin = device.type == "cuda"
        self.width = width
        self.host = torch.zeros((rows, width), dtype=torch.int32, pin_memory=pin)
        self.np = self.host.numpy()
        # What each host row was last filled from (``fill``).
        self.filled_from: list[object] = [None] * rows
        self._staging = torch.zeros(rows * width, dtype=torch.int32, pin_memory=pin)
        self._packed = torch.zeros(rows * width, dtype=torch.int32, device=device)
        self.wide = torch.zeros((rows, width), dtype=torch.int32, device=device) if wide else None

    def fill(self, entries, group: int) -> None:
        """Each entry's table of ``group`` into its host row, unless that row already holds
        this very tuple: a request's tables are one tuple object until the KV manager changes
        them (``Request.frozen_block_ids``: once in 16 tokens for a decode), so a long context
        is not converted again at every step."""
        for row, entry in enumerate(entries):
            table = entry.block_ids[group]
            if self.filled_from[row] is not table:
                self.np[row, : len(table)] = table
                self.filled_from[row] = table

    def upload(self, rows: int, cols: int) -> torch.Tensor:
        """The leading ``rows`` x ``cols`` (rounded up to 16 blocks: the row stride the
        kernels are compiled for stays a multiple of 16) on the device, contiguous."""
        cols = min(-(-cols // 16) * 16, self.width)
        return _upload_packed(self._staging, self._packed, self.np[:rows, :cols])

    def none(self) -> torch.Tensor:
        """A device view of no rows (a step without requests of this kind)."""
        return self._packed[:0].view(0, 1)

    def upload_wide(self, rows: int, cols: int) -> None:
        """``upload``, then into the leading ``rows`` of ``wide`` (a graph's tables)."""
        if rows:
            packed = self.upload(rows, cols)
            self.wide[:rows, : packed.shape[1]].copy_(packed, non_blocking=True)


class _Fields:
    """Several 1-D fields in the rows of one [fields, length] buffer: a step uploads the
    leading entries of them all in one copy (per-field copies cost ~20 µs of host time each).

    The entries go up packed (a pinned staging array, one host-to-device copy) and are spread
    into the fields' rows on the device, as ``_Tables`` does: the whole buffer of the rows'
    fields is 5 x 8192 int64, 320 KB, whose copy had taken ~13 µs of every decode step's
    device time (it runs between two steps' graphs) for the few rows a step reads."""

    def __init__(self, names: tuple[str, ...], length: int, dtype: torch.dtype,
                 device: torch.device) -> None:  # fmt: skip
        self._buffer = _Buffer((len(names), length), dtype, device)
        self.np = {name: self._buffer.np[i] for i, name in enumerate(names)}
        self._device = {name: self._buffer.device[i] for i, name in enumerate(names)}
        pin = device.type == "cuda"
        self._staging = torch.zeros(len(names) * length, dtype=dtype, pin_memory=pin)
        self._packed = torch.zeros(len(names) * length, dtype=dtype, device=device)

    def view(self, name: str, length: int) -> torch.Tensor:
        return self._device[name][:length]

    def upload(self, length: int) -> None:
        """The first ``length`` entries of every field to the device (the rest keep what an
        earlier step left there: a step reads only views of at most ``length`` entries)."""
        full = self._buffer.host.shape[1]
        if length >= full:
            self._buffer.device.copy_(self._buffer.host, non_blocking=True)
            return
        packed = _upload_packed(self._staging, self._packed, self._buffer.np[:, :length])
        self._buffer.device[:, :length].copy_(packed, non_blocking=True)


class InputBatch:
    """Builds ``StepInputs`` for SchedulerOutputs into buffers sized for the largest step."""

    def __init__(
        self,
        *,
        max_num_tokens: int,
        max_num_seqs: int,
        max_model_len: int,
        num_groups: int,
        device: torch.device,
    ) -> None:
        self.max_num_tokens = max_num_tokens
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.table_width = cdiv(max_model_len, BLOCK_SIZE)
        self.num_groups = num_groups
        self.max_rows = max(max_num_tokens, max_num_seqs)
        self.slot_names = tuple(f"slots{group}" for group in range(num_groups))
        # Per row: token, position, K/V slot per group; and the rows to sample.
        self.rows = _Fields(("input_ids", "positions", *self.slot_names, "logits_indices"),
                            self.max_rows, torch.int64, device)  # fmt: skip
        seqs = max_num_seqs
        # Per sequence: lengths, and the prefill chunks' row offsets (seqs + 1 of them); and
        # in element 0 of "valid_rows" the step's number of real rows (in the same copy).
        self.lens = _Fields(("decode_seq_lens", "prefill_seq_lens", "query_start_loc",
                             "valid_rows"), seqs + 1, torch.int32, device)  # fmt: skip
        self.valid_rows = self.lens.view("valid_rows", 1)  # one device view for every step
        self.decode_tables = [
            _Tables(seqs, self.table_width, device, wide=True) for _ in range(num_groups)
        ]
        self.prefill_tables = [
            _Tables(seqs, self.table_width, device, wide=False) for _ in range(num_groups)
        ]
        # Recorded after a step's uploads: the pinned host buffers may be refilled only once
        # those copies ran (a step that reads its tokens back has waited for them anyway).
        self._uploaded = torch.cuda.Event() if device.type == "cuda" else None
        # A padded (CUDA-graph) step's device views depend only on its size and its number of
        # sampled rows: made once each, since building them is most of a step's host time.
        self._padded_views: dict[tuple[int, int], tuple[torch.Tensor, AttentionMetadata,
                                                        torch.Tensor]] = {}  # fmt: skip

    def prepare(
        self,
        output: SchedulerOutput,
        *,
        decode_rows: int | None = None,
        pad_rows: int | None = None,
    ) -> StepInputs:
        """``decode_rows``: pad an all-decode step to this many rows (a captured graph's size);
        the graph then reads the tables at full width (``_Tables.wide``; the padding rows,
        of length 0, read none) and bounds the lengths by ``max_model_len``. ``pad_rows``:
        pad any step to this many rows at its end (a piecewise graph's size): the token
        rows are padded as above, the metadata (lengths, tables) is the step's own."""
        scheduled = output.scheduled
        num_decodes = output.num_decodes
        num_tokens = output.num_tokens
        if num_tokens > self.max_rows or len(scheduled) > self.max_num_seqs:
            raise ValueError(f"step of {num_tokens} tokens / {len(scheduled)} requests too large")
        padded = decode_rows is not None
        if padded and (num_decodes != len(scheduled) or decode_rows < num_decodes):
            raise ValueError("only an all-decode step can be padded")
        if pad_rows is not None and (padded or not num_tokens <= pad_rows <= self.max_rows):
            raise ValueError(f"cannot pad a step of {num_tokens} rows to {pad_rows}")
        total_rows = decode_rows if padded else (pad_rows or num_tokens)
        if self._uploaded is not None:
            self._uploaded.synchronize()
        self._fill_rows(output, total_rows)
        self.lens.np["valid_rows"][0] = num_tokens  # not the padding (one token per decode)
        sampled = [i for i, s in enumerate(scheduled) if s.is_sampled]
        row_ends = np.cumsum([s.num_new_tokens for s in scheduled]) - 1
        self.rows.np["logits_indices"][: len(sampled)] = row_ends[sampled] if sampled else []
        if padded:
            self._fill_lens_and_tables(output, total_rows)
            width = _width(output.scheduled)
            for table in self.decode_tables:
                table.upload_wide(num_decodes, width)
            input_ids, metadata, logits_indices = self._views_of_padded(total_rows, len(sampled))
        else:
            metadata = self._metadata(output, total_rows)
            input_ids = self.rows.view("input_ids", total_rows)
            logits_indices = self.rows.view("logits_indices", len(sampled))
        self.rows.upload(total_rows)
        # Lengths of the decode rows (a padded step's too) and prefills, their row offsets
        # (one more), and valid_rows in entry 0.
        self.lens.upload((decode_rows if padded else len(scheduled)) + 1)
        inputs = StepInputs(
            input_ids=input_ids,
            metadata=metadata,
            logits_indices=logits_indices,
            sampled_request_ids=tuple(scheduled[i].request_id for i in sampled),
            valid_rows=self.valid_rows,
        )
        if self._uploaded is not None:
            self._uploaded.record()
        return inputs

    def _views_of_padded(
        self, rows: int, num_sampled: int
    ) -> tuple[torch.Tensor, AttentionMetadata, torch.Tensor]:
        """(input_ids, metadata, logits_indices) device views of an all-decode step padded to
        ``rows``: the whole tables' width, lengths bounded by max_model_len, no prefills."""
        key = (rows, num_sampled)
        if key not in self._padded_views:
            metadata = AttentionMetadata(
                num_decodes=rows,
                positions=self.rows.view("positions", rows),
                slot_mapping=tuple(self.rows.view(name, rows) for name in self.slot_names),
                decode_block_tables=tuple(t.wide[:rows] for t in self.decode_tables),
                decode_seq_lens=self.lens.view("decode_seq_lens", rows),
                decode_max_seq_len=self.max_model_len,
                prefill_block_tables=tuple(t.none() for t in self.prefill_tables),
                prefill_seq_lens=self.lens.view("prefill_seq_lens", 0),
                prefill_query_start_loc=self.lens.view("query_start_loc", 1),
            )
            self._padded_views[key] = (
                self.rows.view("input_ids", rows),
                metadata,
                self.rows.view("logits_indices", num_sampled),
            )
        return self._padded_views[key]

    def _fill_rows(self, output: SchedulerOutput, total_rows: int) -> None:
        input_ids, positions = self.rows.np["input_ids"], self.rows.np["positions"]
        slots = [self.rows.np[name] for name in self.slot_names]
        decodes = output.scheduled[: output.num_decodes]
        row = len(decodes)
        if decodes:  # one token each: plain Python beats numpy's per-call cost here
            decode_positions = [s.num_computed_tokens for s in decodes]
            input_ids[:row] = [s.token_ids[0] for s in decodes]
            positions[:row] = decode_positions
            for group, group_slots in enumerate(slots):
                group_slots[:row] = [
                    s.block_ids[group][p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
                    for s, p in zip(decodes, decode_positions, strict=True)
                ]
        for entry in output.scheduled[output.num_decodes :]:
            end = row + entry.num_new_tokens
            input_ids[row:end] = entry.token_ids
            positions[row:end] = np.arange(entry.num_computed_tokens, entry.seq_len)
            for group, group_slots in enumerate(slots):
                group_slots[row:end] = _slot_ids(
                    entry.block_ids[group], entry.num_computed_tokens, entry.seq_len
                )
            row = end
        # Padding rows of a graph-sized decode batch: token 0 at position 0, writing nothing.
        input_ids[row:total_rows] = 0
        positions[row:total_rows] = 0
        for group_slots in slots:
            group_slots[row:total_rows] = -1

    def _fill_lens_and_tables(self, output: SchedulerOutput, decode_rows: int) -> None:
        """Host side of the lengths, row offsets and block tables (decode rows from
        ``num_decodes`` to ``decode_rows`` are padding: length 0)."""
        num_decodes = output.num_decodes
        decodes = output.scheduled[:num_decodes]
        prefills = output.scheduled[num_decodes:]
        lens = self.lens.np
        lens["decode_seq_lens"][:num_decodes] = [s.seq_len for s in decodes]
        lens["decode_seq_lens"][num_decodes:decode_rows] = 0
        for group in range(self.num_groups):
            self.decode_tables[group].fill(decodes, group)
            self.prefill_tables[group].fill(prefills, group)
        lens["prefill_seq_lens"][: len(prefills)] = [s.seq_len for s in prefills]
        lens["query_start_loc"][0] = 0
        lens["query_start_loc"][1 : len(prefills) + 1] = np.cumsum(
            [s.num_new_tokens for s in prefills], dtype=np.int64
        )

    def _metadata(self, output: SchedulerOutput, total_rows: int) -> AttentionMetadata:
        """An unpadded step's lengths and tables, filled and uploaded at the widths it needs."""
        num_decodes = output.num_decodes
        decodes = output.scheduled[:num_decodes]
        prefills = output.scheduled[num_decodes:]
        self._fill_lens_and_tables(output, num_decodes)
        decode_width = _width(decodes)
        prefill_width = _width(prefills)
        max_seq_len = max((s.seq_len for s in decodes), default=0)
        return AttentionMetadata(
            num_decodes=num_decodes,
            positions=self.rows.view("positions", total_rows),
            slot_mapping=tuple(self.rows.view(name, total_rows) for name in self.slot_names),
            decode_block_tables=tuple(
                t.upload(num_decodes, decode_width) for t in self.decode_tables
            ),
            decode_seq_lens=self.lens.view("decode_seq_lens", num_decodes),
            decode_max_seq_len=max_seq_len,
            prefill_block_tables=tuple(
                t.upload(len(prefills), prefill_width) for t in self.prefill_tables
            ),
            prefill_seq_lens=self.lens.view("prefill_seq_lens", len(prefills)),
            prefill_query_start_loc=self.lens.view("query_start_loc", len(prefills) + 1),
        )


def _slot_ids(table: tuple[int, ...], start: int, end: int) -> np.ndarray:
    positions = np.arange(start, end)
    blocks = np.asarray(table, dtype=np.int64)[positions // BLOCK_SIZE]
    return blocks * BLOCK_SIZE + positions % BLOCK_SIZE


def _width(entries) -> int:
    return max((cdiv(s.seq_len, BLOCK_SIZE) for s in entries), default=1)
