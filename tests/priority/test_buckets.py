"""The executor's bucket layout (commsched/priority/buckets.py) on hand-worked examples:
pure, no process group, no torch."""

from __future__ import annotations

import subprocess
import sys

from commsched.priority.buckets import LOCAL, GradSlot, group_ids, plan_buckets
from commsched.priority.policy import ScheduleConfig


def _spans(layout):
    return [[(pc.tensor, pc.offset, pc.numel) for pc in op.pieces] for op in layout.ops]


def test_local_entries_go_last_and_carry_no_operation():
    slots = [GradSlot(LOCAL, "float32", 3, 4), GradSlot(0, "float32", 4, 4), GradSlot(0, "float32", 2, 4)]
    lay = plan_buckets(slots, ScheduleConfig(policy="lina", microop_bytes=1 << 20))
    assert lay.order == (1, 2, 0)
    assert _spans(lay) == [[(0, 0, 4)], [(1, 0, 2)]]  # a micro-op never spans two tensors
    assert lay.ops_of_param == ((0,), (1,), ())
    assert lay.op_first == (0, 0)


def test_micro_ops_are_equal_slices_of_one_tensor():
    # 10 and 6 float32 elements in group 0, 8 in group 1; 16-byte micro-ops (at most 4 elements):
    # 10 -> 4 + 3 + 3, 6 -> 3 + 3, 8 -> 4 + 4
    slots = [GradSlot(0, "float32", 10, 4), GradSlot(0, "float32", 6, 4), GradSlot(1, "float32", 8, 4)]
    lay = plan_buckets(slots, ScheduleConfig(policy="lina", microop_bytes=16))
    assert _spans(lay) == [[(0, 0, 4)], [(0, 4, 3)], [(0, 7, 3)], [(1, 0, 3)], [(1, 3, 3)],
                           [(2, 0, 4)], [(2, 4, 4)]]
    assert [op.seq for op in lay.ops] == list(range(7))
    assert [op.nbytes for op in lay.ops] == [16, 12, 12, 12, 12, 16, 16]
    assert lay.op_first == (0, 0, 0, 0, 0, 2, 2)
    assert lay.ops_of_param == ((0, 1, 2), (3, 4), (5, 6))


def test_fifo_buckets_never_span_two_groups():
    slots = [GradSlot(0, "float32", 4, 4), GradSlot(0, "float32", 4, 4), GradSlot(1, "float32", 4, 4)]
    lay = plan_buckets(slots, ScheduleConfig(policy="fifo", bucket_bytes=1 << 20))
    assert _spans(lay) == [[(0, 0, 4), (1, 0, 4)], [(2, 0, 4)]]
    assert lay.op_first == (0, 2)
    assert lay.ops_of_param == ((0,), (0,), (1,))


def test_fifo_buckets_split_at_a_dtype_change():
    slots = [GradSlot(0, "float32", 4, 4), GradSlot(0, "bfloat16", 4, 2), GradSlot(0, "bfloat16", 4, 2)]
    lay = plan_buckets(slots, ScheduleConfig(policy="fifo", bucket_bytes=1 << 20))
    assert _spans(lay) == [[(0, 0, 4)], [(1, 0, 4), (2, 0, 4)]]
    assert [op.nbytes for op in lay.ops] == [16, 16]


def test_group_ids_are_by_identity():
    a, b = object(), object()
    assert group_ids([a, LOCAL, b, a, None, None]) == [0, LOCAL, 1, 0, 2, 2]


def test_the_planner_imports_without_torch():
    code = "import sys, commsched.priority.buckets; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
