"""Decodes of several sequences (llama-server's slots, a multi-sequence driver) become one decode
per sequence, and each sequence's requests become flows of their own (docs/flow.md)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from featdiff.core.names import API_OP
from featdiff.core.phases import Phase
from featdiff.dump.manifest import Manifest
from featdiff.dump.reader import read_dump
from featdiff.dump.records import Record
from featdiff.dump.writer import DumpWriter
from featdiff.llama import spool
from featdiff.llama.spool_index import RecordEvent
from featdiff.programs.phases import derive_rounds, flow_evals, whole_calls, with_encoder_rows
from featdiff.programs.run_log import ExecContext, ExecEval, ExecLog
from featdiff.programs.sequences import Split, equal_graphs, graph_rows, seq_graphs, seq_runs, split_decodes

E = -1  # an embedding row


def _log(evals, records=()) -> ExecLog:
    """evals as (ctx, token_ids, positions, seq_ids); ctx 0 target, 1 draft; every row an output."""
    ctxs = (ExecContext(0, "target", "qwen3", "T.gguf", True), ExecContext(1, "draft", "dflash", "D.gguf", True))
    evs = tuple(ExecEval(i, c, tuple(t), tuple(p), tuple(s), (1,) * len(p), 0) for i, (c, t, p, s) in enumerate(evals))
    return ExecLog("libllama.so", ctxs, evs, (), tuple(records), 0)


def _record(ev: int, name: str, n_rows: int, width: int = 4, offset: int = 0, ubatch: int = 0) -> RecordEvent:
    return RecordEvent(eval=ev, role="target", name=name, occurrence=0, op="", ggml_type="f32", ne=(width, n_rows, 1, 1),
                       nb=(), srcs=(), dtype="float32", offset=offset, nbytes=4 * width * n_rows, ubatch=ubatch)  # fmt: skip


ONE_STREAM = {0: Split(512), 1: Split(512)}
TWO_STREAMS = {0: Split(4, 2), 1: Split(4, 2)}


def split_sequences(log, splits=ONE_STREAM):
    return split_decodes(log, splits)


def test_seq_runs_are_contiguous_runs_in_graph_order():
    assert seq_runs((0, 1, 2, 3, 4), (1, 1, 0, 0, 0)) == ((0, 1), (2, 3, 4))
    assert seq_runs((0, 1, 2), (0, 1, 0)) is None


def test_graphs_follow_llama_cpps_split_simple_and_split_equal():
    assert graph_rows((0,) * 5, Split(2)) == ((0, 1), (2, 3), (4,))
    assert graph_rows((0, 1), Split(None)) == ((0, 1),)
    # a stream per sequence: consecutive sequence ids from the first unused row's, as many of each
    assert equal_graphs((1, 1, 1, 1, 0, 0), 512) == ((0, 1, 2, 3), (4, 5))
    assert equal_graphs((0, 0, 0, 0, 1, 1), 512) == ((0, 1, 4, 5), (2, 3))
    assert equal_graphs((0,) * 4 + (1,) * 4, 4) == ((0, 1, 4, 5), (2, 3, 6, 7))


def test_split_equal_follows_llama_cpp_unsequential_with_rollback_tails_and_split_seq():
    prompts = (0,) * 25 + (1,) * 34  # two prompts, one decode
    assert [len(g) for g in equal_graphs(prompts, 512, sequential=False)] == [50, 9]
    # a verify of 2 rows beside one of 1: the 2-row sequence would leave 1 < 4 rows behind, so it
    # goes alone and whole (a recurrent memory keeps its last n_rs_seq + 1 rows in one graph)
    assert equal_graphs((0, 0, 1), 512, keep_tail=4) == ((0, 1), (2,))
    assert equal_graphs((0, 0, 1), 512) == ((0, 2), (1,))
    assert equal_graphs((0,) * 6, 4, keep_tail=3) == ((0, 1, 2), (3, 4, 5))  # cut back: 3 rows left
    assert seq_graphs((1, 1, 0, 0, 0), 2) == ((0, 1), (2, 3), (4,))
    # the guess of a context keeping 3 rollback snapshots, one KV stream, then a stream each
    assert graph_rows((0, 0, 1), Split(512, 1, 3)) == ((0, 1), (2,))
    assert graph_rows((1, 1, 0), Split(512, 2, 3)) == ((0, 1), (2,))


def test_a_decode_the_records_show_split_otherwise_takes_the_split_that_fits_them():
    """A hybrid target's prefill of two prompts (25 and 34 rows) on one stream, noted without its
    snapshots (an older preload): the records show graphs of 50 and 9 rows, as split_equal
    computed them, not the one graph split_simple would; each part gets its rows."""
    seqs = [0] * 25 + [1] * 34
    positions = list(range(25)) + list(range(34))
    records = [_record(0, "l_out-0", 50), _record(0, "l_out-0", 9, offset=800, ubatch=1)]
    split = split_decodes(_log([(0, [5] * 59, positions, seqs)], records), {0: Split(512)})
    assert split.notes == ()
    got = [(e.seq_ids[0], e.positions[0], e.positions[-1]) for e in split.log.evals]
    assert got == [(0, 0, 24), (1, 0, 24), (1, 25, 33)]
    assert [(r.eval, r.ne[1], r.offset) for r in split.log.records] == [(0, 25, 0), (1, 25, 400), (2, 9, 800)]


def test_records_two_splits_fit_with_other_rows_are_kept_whole_unless_the_context_says_which():
    """Rows (0, 0, 1) computed as graphs of 2 and 1 rows: split_equal gives (0, 2), (1); with
    rollback tails, or split_seq, (0, 1), (2). A context noted with 3 snapshots says which; one
    noted without them (split_simple: one graph) does not, and the decode stays whole, said so."""
    records = [_record(0, "l_out-0", 2), _record(0, "l_out-0", 1, offset=32, ubatch=1)]
    log = _log([(0, [5, 6, 7], [7, 8, 4], [0, 0, 1])], records)
    split = split_decodes(log, {0: Split(512, 1, 3)})
    assert split.notes == () and [e.seq_ids for e in split.log.evals] == [(0, 0), (1,)]
    split = split_decodes(log, {0: Split(512)})
    assert len(split.log.evals) == 1 and "as 2 of llama.cpp's splits would, with other rows" in split.notes[0]


def test_an_empty_output_record_and_m_ropes_positions_split_with_their_graph():
    """A catch-up decode of two sequences that outputs no row (MTP's) keeps its empty logits in
    each part; an inp_pos of four positions per token (M-RoPE) keeps the first section's rows."""
    log = _log([(1, [5, 6, 7, 8, 9], [0, 1, 2, 0, 1], [0, 0, 0, 1, 1])])
    log = replace(log, evals=(replace(log.evals[0], outputs=(0,) * 5),))
    empty = replace(_record(0, "result_output", 0, width=512), nbytes=0)
    pos = replace(_record(0, "inp_pos", 5, width=4), ne=(20, 1, 1, 1), nbytes=80, offset=1000)
    split = split_decodes(replace(log, records=(_record(0, "l_out-0", 5), empty, pos)), {1: Split(512)})
    assert split.notes == ()
    by = [(r.eval, r.name, r.ne[0], r.offset, r.nbytes) for r in split.log.records]
    assert (0, "result_output", 512, 0, 0) in by and (1, "result_output", 512, 0, 0) in by
    assert (0, "inp_pos", 3, 1000, 12) in by and (1, "inp_pos", 2, 1012, 8) in by


def test_an_eagle3_encoder_call_of_two_sequences_splits_like_the_rows_it_encodes():
    """The encoder runs on the target call's rows in sequence 0 at placeholder positions: it
    takes the sequences and positions of those rows, and splits per sequence as one graph."""
    ctxs = (ExecContext(0, "target", "qwen3", "T.gguf", True), ExecContext(1, "draft", "eagle3", "D.gguf", True))
    evs = (
        ExecEval(0, 0, (5, 6, 7, 8), (3, 4, 0, 1), (1, 1, 0, 0), (1, 1, 1, 1), 0),
        ExecEval(1, 1, (E,) * 4, (9, 10, 11, 12), (0,) * 4, (1,) * 4, 0, "encode"),
    )
    log = ExecLog("libllama.so", ctxs, evs, (), (replace(_record(1, "fc_out", 4), role="draft"),), 0)
    split = split_decodes(with_encoder_rows(log), {0: Split(512, 2), 1: Split(512, 2)})
    enc = [(e.seq_ids, e.positions) for e in split.log.evals if e.call == "encode"]
    assert enc == [((1, 1), (3, 4)), ((0, 0), (0, 1))]
    assert [(r.eval, r.ne[1]) for r in split.log.records] == [(2, 2), (3, 2)]


def test_a_decode_of_two_sequences_becomes_two_with_their_rows_and_records():
    log = _log([(0, [5, 6, 7, 8, 9], [0, 1, 2, 0, 1], [0, 0, 0, 1, 1])], [_record(0, "l_out-1", 5, offset=100)])
    split = split_sequences(log)
    assert [(e.eval, e.positions, e.seq_ids) for e in split.log.evals] == [
        (0, (0, 1, 2), (0, 0, 0)),
        (1, (0, 1), (1, 1)),
    ]
    cut = [(r.eval, r.ne[1], r.offset, r.nbytes) for r in split.log.records]
    assert cut == [(0, 3, 100, 48), (1, 2, 148, 32)]
    assert split.notes == ()


def test_interleaved_sequences_are_kept_whole_and_said_so():
    split = split_sequences(_log([(0, [5, 6, 7], [0, 0, 1], [0, 1, 0])]))
    assert len(split.log.evals) == 1 and "not contiguous" in split.notes[0]


def test_a_two_stream_batch_splits_into_graphs_of_whole_sequences():
    """A verify of sequence 1 batched with a prefill of sequence 0 on a stream per sequence:
    two graphs (split_equal takes increasing sequence ids), each one sequence's rows."""
    records = [_record(0, "embd", 4), _record(0, "embd", 6, offset=64, ubatch=1)]
    log = _log([(0, [81, 16, 16, 16, 300, 301, 302, 303, 304, 305], [8, 9, 10, 11, 0, 1, 2, 3, 4, 5], [1] * 4 + [0] * 6)],
               records)  # fmt: skip
    split = split_decodes(log, {0: Split(512, 2)})
    assert [(e.seq_ids[0], e.positions[0], len(e.positions)) for e in split.log.evals] == [(1, 8, 4), (0, 0, 6)]
    assert [(r.eval, r.ne[1], r.offset) for r in split.log.records] == [(0, 4, 0), (1, 6, 64)]
    assert split.notes == ()


def test_more_graphs_than_the_split_makes_are_kept_whole_and_said_so():
    records = [_record(0, "embd", 2, ubatch=u) for u in range(3)]
    split = split_decodes(_log([(0, [5, 6, 7, 8], [0, 1, 2, 3], [0] * 4)], records), {0: Split(2)})
    assert len(split.log.evals) == 1 and "computed as 3 graphs" in split.notes[0]


def test_two_sequences_drafting_at_once_are_two_flows_with_their_own_rounds():
    log = _log(
        [
            (0, [5, 6, 7, 8, 9], [0, 1, 2, 0, 1], [0, 0, 0, 1, 1]),  # both prompts, one decode
            (1, [E, E, E], [0, 1, 2], [0, 0, 0]),  # seq 0's inject
            (1, [E, E], [0, 1], [1, 1]),  # seq 1's inject
            (1, [8, 3, 3, 3, 10, 3, 3, 3], [3, 4, 5, 6, 2, 3, 4, 5], [0] * 4 + [1] * 4),  # both blocks
            (0, [8, 11, 10, 12], [3, 4, 2, 3], [0, 0, 1, 1]),  # both verifies
        ]
    )
    evals = flow_evals(split_sequences(log).log)
    got = [(e.role, e.phase, e.round, e.flow, e.seq_ids[0]) for e in evals]
    assert got == [
        ("target", "prefill", 0, 0, 0),
        ("target", "prefill", 0, 1, 1),
        ("draft", "inject", 0, 0, 0),
        ("draft", "inject", 0, 1, 1),
        ("draft", "draft", 1, 0, 0),
        ("draft", "draft", 1, 1, 1),
        ("target", "verify", 1, 0, 0),
        ("target", "verify", 1, 1, 1),
    ]


def test_a_request_reusing_a_cached_prefix_is_a_new_flow_that_starts_there():
    log = _log(
        [
            (0, [5, 6, 7], [0, 1, 2], [0, 0, 0]),  # request 1 prefill
            (1, [E, E, E], [0, 1, 2], [0, 0, 0]),
            (1, [8, 3, 3, 3], [3, 4, 5, 6], [0] * 4),
            (0, [8, 11, 12, 13], [3, 4, 5, 6], [0] * 4),
            (0, [9, 4], [2, 3], [0, 0]),  # request 2: positions 0, 1 kept from request 1
        ]
    )
    evals = flow_evals(split_sequences(log).log)
    assert [(e.phase, e.flow) for e in evals] == [
        ("prefill", 0),
        ("inject", 0),
        ("draft", 0),
        ("verify", 0),
        ("prefill", 1),
    ]


def test_the_graphs_of_one_call_share_its_phase_and_round():
    """A verify of two sequences on a stream each, computed as two graphs (3 rows of each, then
    sequence 0's last row): sequence 0's two parts are one verify, not a verify of no drafts."""
    log = _log(
        [
            (0, [5, 6, 7], [0, 1, 2], [0, 0, 0]),
            (0, [9, 6, 7], [0, 1, 2], [1, 1, 1]),
            (1, [8, 3, 3, 3, 10, 3, 3, 3], [3, 4, 5, 6, 3, 4, 5, 6], [0] * 4 + [1] * 4),
            (0, [8, 11, 12, 13, 10, 11, 12], [3, 4, 5, 6, 3, 4, 5], [0] * 4 + [1] * 3),
        ],
        [_record(3, "embd", 6), _record(3, "embd", 1, offset=96, ubatch=1)],
    )
    split = split_decodes(log, {0: Split(6, 2), 1: Split(6, 2)})
    evals = flow_evals(split.log)
    verify = [
        (e.seq_ids[0], e.phase, e.round, e.n_tokens) for e in evals if e.role == "target" and e.phase != "prefill"
    ]
    assert verify == [(0, "verify", 1, 3), (1, "verify", 1, 3), (0, "verify", 1, 1)]


def test_a_verify_computed_as_two_graphs_is_one_round():
    log = _log(
        [
            (0, [5, 6, 7], [0, 1, 2], [0, 0, 0]),
            (0, [9, 6, 7], [0, 1, 2], [1, 1, 1]),
            (1, [8, 3, 3, 3, 10, 3, 3, 3], [3, 4, 5, 6, 3, 4, 5, 6], [0] * 4 + [1] * 4),
            (0, [8, 11, 12, 13, 10, 11, 12], [3, 4, 5, 6, 3, 4, 5], [0] * 4 + [1] * 3),
            (0, [20], [5], [0]),  # sequence 0 goes on after accepting 1 draft
        ],
        [_record(3, "embd", 6), _record(3, "embd", 1, offset=96, ubatch=1)],
    )
    evals = flow_evals(split_decodes(log, {0: Split(6, 2), 1: Split(6, 2)}).log)
    own = tuple(e for e in evals if e.seq_ids[0] == 0)
    merged, parts = whole_calls(own)
    (r,) = derive_rounds(merged, {})
    assert (r.pos0, r.drafts, r.accepted, r.target_tokens) == (3, (11, 12, 13), 1, (11, 20))
    assert next(e.eval for e in own if e.phase == "verify") in parts.values()


def test_a_decode_kept_whole_numbers_its_graphs_records_on_so_no_two_share_a_key():
    records = [_record(0, "embd", 2, ubatch=u) for u in range(3)]
    split = split_decodes(_log([(0, [5, 6, 7, 8], [0, 1, 2, 3], [0] * 4)], records), {0: Split(2)})
    assert [(r.eval, r.name, r.occurrence) for r in split.log.records] == [
        (0, "embd", 0),
        (0, "embd", 1),
        (0, "embd", 2),
    ]


MIXED_BATCHES = {  # (decodes, records, splits): every multi-sequence batch shape a server makes
    "two prompts in one prefill": ([(0, [5, 6, 7, 8, 9], [0, 1, 2, 0, 1], [0, 0, 0, 1, 1])], [(0, 5, 0)], ONE_STREAM),
    "a prefill beside a verify": (
        [(0, [81, 16, 16, 16, 300, 301, 302], [8, 9, 10, 11, 0, 1, 2], [1] * 4 + [0] * 3)],
        [(0, 4, 0), (0, 3, 1)],
        {0: Split(512, 2)},
    ),
    "two slots' draft blocks": ([(1, [8, 3, 3, 3, 10, 3, 3, 3], [3, 4, 5, 6, 2, 3, 4, 5], [0] * 4 + [1] * 4)], [(0, 8, 0)], ONE_STREAM),
    "micro-batches of mixed sequences": ([(0, [1, 2, 3, 4, 5, 6], [0, 1, 2, 0, 1, 2], [0, 0, 0, 1, 1, 1])], [(0, 4, 0), (0, 2, 1)], {0: Split(4)}),
    "a split featdiff does not model": ([(0, [1, 2, 3, 4], [0, 1, 0, 1], [0, 0, 1, 1])], [(0, 1, u) for u in range(4)], {0: Split(2)}),
}  # fmt: skip


@pytest.mark.parametrize("shape", MIXED_BATCHES)
def test_every_multi_sequence_batch_shape_packs_into_a_dump_featdiff_reads(shape, tmp_path):
    decodes, cuts, splits = MIXED_BATCHES[shape]
    records = [_record(ev, "l_out-0", rows, ubatch=u) for ev, rows, u in cuts]
    records += [replace(r, name="Qcur-0", occurrence=1) for r in records]  # a name twice in each graph
    split = split_decodes(_log(decodes, records), splits)
    data = tmp_path / "run.npz.spool.data"
    data.write_bytes(bytes(max(r.offset + r.nbytes for r in split.log.records)))
    evals = flow_evals(split.log)
    writer = DumpWriter(tmp_path / "run.npz")
    written = spool.write_records(writer, split.log.records, evals, data)
    writer.close(Manifest(source="llama.cpp", models={}, build={}, evals=evals, records=()))
    with read_dump(tmp_path / "run.npz") as dump:
        assert len(dump.manifest.records) == len(written.names) == len(split.log.records) and not written.dropped


def test_the_dump_writer_refuses_a_key_twice_and_leaves_nothing(tmp_path):
    writer = DumpWriter(tmp_path / "run.npz")
    record = Record(key="e00000.target.embd.0", role="target", phase=Phase.PREFILL, eval=0, name="embd", occurrence=0,
                    op="GET_ROWS", ggml_type="f32", ne=(4, 2), srcs=(), dtype="float32", shape=(2, 4))  # fmt: skip
    writer.add(record, np.zeros((2, 4), np.float32))
    with pytest.raises(ValueError, match="e00000.target.embd.0 written twice"):
        writer.add(record, np.zeros((2, 4), np.float32))
    assert list(tmp_path.iterdir()) == []


def test_a_last_layer_with_one_output_row_per_graph_splits_by_sequence():
    """A prefill of two prompts on a stream each, the second longer: the first graph holds one
    output row (the first prompt's last), the record's one row (ggml ne [n_embd, 1])."""
    log = _log([(0, [1, 2, 3, 4, 5, 6], [0, 1, 0, 1, 2, 3], [0, 0, 1, 1, 1, 1])])
    log = replace(log, evals=(replace(log.evals[0], outputs=(0, 1, 0, 0, 0, 1)),))
    records = (_record(0, "l_out-5", 1, width=8), _record(0, "l_out-5", 1, width=8, offset=32, ubatch=1))
    split = split_decodes(replace(log, records=records), {0: Split(4, 2)})
    assert split.notes == ()
    assert [(e.seq_ids[0], len(e.positions)) for e in split.log.evals] == [(0, 2), (1, 2), (1, 2)]
    assert [(r.eval, r.offset) for r in split.log.records] == [(0, 0), (2, 32)]


def test_a_read_back_of_a_call_computed_as_two_graphs_splits_by_its_output_rows():
    """Three slots' draft blocks in one batch on a stream each (sequences 0, 1, 3: split_equal
    takes 0 and 1, then 3): the nodes come per graph, `draft_logits` (read back through the API
    after the call, ubatch 0) holds every output row of the call, in batch order."""
    seqs = [0] * 4 + [1] * 4 + [3] * 4
    log = _log([(1, [8, 3, 3, 3, 9, 3, 3, 3, 10, 3, 3, 3], [5, 6, 7, 8] * 3, seqs)])
    logits = replace(_record(0, "draft_logits", 12), op=API_OP, role="draft")
    records = [_record(0, "l_out-0", 8), _record(0, "l_out-0", 4, offset=128, ubatch=1), logits]
    split = split_decodes(replace(log, records=tuple(records)), {1: Split(512, 4)})
    assert split.notes == ()
    assert [e.seq_ids[0] for e in split.log.evals] == [0, 1, 3]
    read_back = [(r.eval, r.ne[1], r.offset) for r in split.log.records if r.name == "draft_logits"]
    assert read_back == [(0, 4, 0), (1, 4, 64), (2, 4, 128)]
