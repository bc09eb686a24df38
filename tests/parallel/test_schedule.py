"""Pipeline schedules and the timeline simulator (pure Python, no TF)."""

import itertools

import pytest

from tfmgpu.parallel import schedule
from tfmgpu.parallel import timeline as timeline_lib

FORWARD, BACKWARD = schedule.FORWARD, schedule.BACKWARD
SCHEDULES = ["gpipe", "1f1b"]
GRID = [(k, m) for k in (1, 2, 3, 4, 8) for m in (1, 2, 3, 4, 8, 16)]


def _assert_valid(timeline, forward, backward):
  """Every task once, its cost, no overlap on a stage, dependencies met."""
  K, M = timeline.num_stages, timeline.micro_batches
  tasks = [e.task for e in timeline.events]
  assert sorted(tasks) == sorted(
      schedule.Task(k, m, kind) for k in range(K) for m in range(M)
      for kind in (FORWARD, BACKWARD))
  end = {e.task: e.end for e in timeline.events}
  for e in timeline.events:
    cost = (forward if e.task.kind == FORWARD else backward)[e.task.stage]
    assert e.end - e.start == pytest.approx(cost)
    for dep in schedule.dependencies(e.task, K, M, timeline.schedule):
      assert end[dep] <= e.start + 1e-12, (e.task, dep)
  for k in range(K):
    spans = sorted((e.start, e.end) for e in timeline.events
                   if e.task.stage == k)
    for (_, a_end), (b_start, _) in zip(spans, spans[1:]):
      assert a_end <= b_start + 1e-12, f"overlap on stage {k}"


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize("num_stages,micro_batches", GRID)
def test_equal_stages_give_the_textbook_bubble(name, num_stages,
                                               micro_batches):
  f, b = 1.0, 2.0
  timeline = timeline_lib.simulate(f, b, micro_batches, schedule=name,
                                   num_stages=num_stages)
  want = (num_stages - 1) / (micro_batches + num_stages - 1)
  assert timeline.bubble_fraction == pytest.approx(want)
  assert timeline.theoretical_bubble == pytest.approx(want)
  assert timeline.step_time == pytest.approx(
      (micro_batches + num_stages - 1) * (f + b))
  assert timeline.busy == pytest.approx([micro_batches * (f + b)] *
                                        num_stages)
  _assert_valid(timeline, [f] * num_stages, [b] * num_stages)


@pytest.mark.parametrize("name", SCHEDULES)
def test_unequal_stages_and_transfers_give_a_valid_timeline(name):
  forward, backward = [1.0, 3.0, 2.0], [2.5, 5.0, 1.0]
  timeline = timeline_lib.simulate(forward, backward, 5, schedule=name,
                                   transfer_time=0.25)
  _assert_valid(timeline, forward, backward)
  # The slowest stage bounds the step from below; its own work must fit.
  assert timeline.step_time >= 5 * (3.0 + 5.0)
  assert 0.0 < timeline.bubble_fraction < 1.0


def test_one_stage_never_idles():
  timeline = timeline_lib.simulate([2.0], [3.0], 4)
  assert timeline.step_time == pytest.approx(20.0)
  assert timeline.bubble_fraction == pytest.approx(0.0)


@pytest.mark.parametrize("num_stages,micro_batches",
                         itertools.product((2, 3, 4, 6), (1, 2, 4, 8, 16)))
def test_1f1b_holds_at_most_k_micro_batches_gpipe_holds_m(num_stages,
                                                          micro_batches):
  one_f = schedule.stage_orders(num_stages, micro_batches, "1f1b")
  gpipe = schedule.stage_orders(num_stages, micro_batches, "gpipe")
  for k in range(num_stages):
    assert schedule.peak_in_flight(one_f[k]) == min(num_stages - k,
                                                    micro_batches)
    assert schedule.peak_in_flight(gpipe[k]) == micro_batches
  timeline = timeline_lib.simulate(1.0, 2.0, micro_batches,
                                   schedule="1f1b", num_stages=num_stages)
  assert max(timeline.peak_in_flight) <= num_stages


def test_orders_are_the_documented_ones():
  show = lambda orders: [" ".join(str(t) for t in o) for o in orders]
  assert show(schedule.stage_orders(2, 3, "gpipe")) == [
      "F(0,0) F(0,1) F(0,2) B(0,2) B(0,1) B(0,0)",
      "F(1,0) F(1,1) F(1,2) B(1,2) B(1,1) B(1,0)"]
  assert show(schedule.stage_orders(3, 4, "1f1b")) == [
      "F(0,0) F(0,1) F(0,2) B(0,0) F(0,3) B(0,1) B(0,2) B(0,3)",
      "F(1,0) F(1,1) B(1,0) F(1,2) B(1,1) F(1,3) B(1,2) B(1,3)",
      "F(2,0) B(2,0) F(2,1) B(2,1) F(2,2) B(2,2) F(2,3) B(2,3)"]
  assert show(schedule.stage_orders(2, 2, "1f1b", forward_only=True)) == [
      "F(0,0) F(0,1)", "F(1,0) F(1,1)"]


def test_build_order_reports_a_deadlock():
  a0, a1 = schedule.Task(0, 0, BACKWARD), schedule.Task(1, 0, FORWARD)
  deps = {a0: [a1], a1: [a0]}
  with pytest.raises(ValueError, match=r"deadlock.*B\(0,0\).*F\(1,0\)"):
    schedule.build_order([[a0], [a1]], lambda t: deps[t])


def test_text_draws_one_row_per_stage():
  timeline = timeline_lib.simulate([1.0, 1.0, 1.0], [2.0, 2.0, 2.0], 4)
  lines = timeline.text(width=54).splitlines()
  rows = [l for l in lines if l.startswith("stage ")]
  assert len(rows) == 3
  assert all(len(r.split("|")[1]) == 54 for r in rows)
  # Stage 0 starts with micro-batch 0's forward; the last stage waits for
  # it first (idle), and backward letters end stage 0's row.
  assert rows[0].split("|")[1].startswith("0")
  assert rows[2].split("|")[1].startswith(".")
  assert rows[0].split("|")[1].rstrip(".").endswith("a")
  assert "bubble=0.333" in lines[0]
  assert "(K-1)/(M+K-1)=0.333" in lines[0]


def test_plot_writes_a_png_or_says_matplotlib_is_missing(tmp_path):
  timeline = timeline_lib.simulate(1.0, 2.0, 4, num_stages=2)
  path = str(tmp_path / "timeline.png")
  try:
    import matplotlib  # noqa: F401  # pylint: disable=g-import-not-at-top,unused-import
  except ImportError:
    with pytest.raises(ImportError,
                       match=r"the plots extra of tfmgpu: pip install "
                       r".tfmgpu\[plots\]."):
      timeline.plot(path)
    return
  assert timeline.plot(path) == path
  with open(path, "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("kwargs,message", [
    (dict(forward_times=1.0, backward_times=1.0, micro_batches=0,
          num_stages=2), r"micro_batches=0 must be an int >= 1"),
    (dict(forward_times=1.0, backward_times=1.0, micro_batches=2),
     r"forward_times=1.0 is one number; pass num_stages"),
    (dict(forward_times=[1.0, 2.0], backward_times=[1.0], micro_batches=2),
     r"backward_times has 1 time\(s\) but num_stages=2"),
    (dict(forward_times=[1.0, -2.0], backward_times=1.0, micro_batches=2),
     r"non-negative"),
    (dict(forward_times=1.0, backward_times=1.0, micro_batches=2,
          num_stages=2, schedule="interleaved"),
     r"schedule='interleaved' is unknown. Choose one of 'gpipe', '1f1b'"),
])
def test_bad_arguments_are_named(kwargs, message):
  with pytest.raises(ValueError, match=message):
    timeline_lib.simulate(**kwargs)


@pytest.mark.parametrize("devices,virtual,micro_batches",
                         [(2, 2, 4), (2, 3, 4), (4, 2, 8), (3, 2, 6), (2, 2, 2)])
def test_interleaved_1f1b_divides_the_bubble_by_the_virtual_stages(
    devices, virtual, micro_batches):
  """Each device runs only its chunks (c % K), every task once, without a
  deadlock; with equal chunk times (a stage's split in V) the bubble is
  (K-1)/(V*M+K-1), below plain 1F1B's on the same stages."""
  chunks = devices * virtual
  orders = schedule.device_orders(devices, micro_batches, "1f1b",
                                  virtual_stages=virtual)
  assert len(orders) == devices
  for d, order in enumerate(orders):
    assert {t.stage % devices for t in order} == {d}
    assert sorted(order) == sorted(
        schedule.Task(c, m, kind) for c in range(d, chunks, devices)
        for m in range(micro_batches)
        for kind in (schedule.FORWARD, schedule.BACKWARD))
  interleaved = timeline_lib.simulate(
      [1.0 / virtual] * chunks, [2.0 / virtual] * chunks, micro_batches,
      schedule="1f1b", virtual_stages=virtual)
  plain = timeline_lib.simulate([1.0] * devices, [2.0] * devices,
                                micro_batches, schedule="1f1b")
  assert interleaved.bubble_fraction == pytest.approx(
      (devices - 1) / (virtual * micro_batches + devices - 1))
  assert interleaved.bubble_fraction == pytest.approx(
      interleaved.theoretical_bubble)
  assert interleaved.bubble_fraction < plain.bubble_fraction
  assert interleaved.busy == pytest.approx(plain.busy)
  assert len(interleaved.text().splitlines()) == devices + 2


def test_interleaved_order_is_megatrons():
  """K=2, V=2, M=4: device 0 warms up with (K-d-1)*2+(V-1)*K = 4 forwards,
  groups of K micro-batches through chunk 0, then chunk 2."""
  d0, d1 = schedule.device_orders(2, 4, "1f1b", virtual_stages=2)
  assert " ".join(map(str, d0)) == (
      "F(0,0) F(0,1) F(2,0) F(2,1) F(0,2) B(2,0) F(0,3) B(2,1) F(2,2) "
      "B(0,0) F(2,3) B(0,1) B(2,2) B(2,3) B(0,2) B(0,3)")
  assert [str(t) for t in d1[:3]] == ["F(1,0)", "F(1,1)", "F(3,0)"]


@pytest.mark.parametrize("kwargs,message", [
    (dict(virtual_stages=0), r"virtual_stages=0 must be an int >= 1"),
    (dict(virtual_stages=2, schedule="gpipe"),
     r"virtual_stages=2 interleaves 1F1B; schedule='gpipe' cannot"),
    (dict(virtual_stages=2, micro_batches=3),
     r"micro_batches=3 must be a multiple of the 2 devices .* "
     r"micro_batches=4"),
])
def test_interleaving_errors_are_named(kwargs, message):
  args = {"num_devices": 2, "micro_batches": 4, "schedule": "1f1b", **kwargs}
  with pytest.raises(ValueError, match=message):
    schedule.device_orders(**args)


@pytest.mark.parametrize("virtual", [1, 2, 3])
def test_sends_are_charged_to_the_sending_device(virtual):
  """`send_time` lands on every task whose output crosses devices: each
  micro-batch sends K*V-1 activations and as many gradients, so the busy
  time grows by 2*M*(K*V-1)*send_time, V times as much with V chunks."""
  devices, m, send = 2, 4, 0.05
  chunks = devices * virtual
  args = ([1.0 / virtual] * chunks, [2.0 / virtual] * chunks, m)
  kwargs = dict(schedule="1f1b", virtual_stages=virtual)
  free = timeline_lib.simulate(*args, **kwargs)
  charged = timeline_lib.simulate(*args, send_time=send, **kwargs)
  assert sum(charged.busy) - sum(free.busy) == pytest.approx(
      2 * m * (chunks - 1) * send)
  assert charged.step_time > free.step_time
  with pytest.raises(ValueError, match=r"send_time=-1 must be >= 0"):
    timeline_lib.simulate(*args, send_time=-1, **kwargs)


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("m", [1, 4])
def test_devices_that_share_their_compute(name, m):
  """`concurrency`: devices that take turns (1.0) never overlap, so a step
  is all the work; enough compute for every device is the plain timeline;
  half a device's worth doubles every time."""
  args = ([1.0, 1.5], [2.0, 3.0], m)
  plain = timeline_lib.simulate(*args, schedule=name)
  work = m * (1.0 + 1.5 + 2.0 + 3.0)
  turns = timeline_lib.simulate(*args, schedule=name, concurrency=1.0)
  assert turns.step_time == pytest.approx(work)
  assert sum(turns.busy) >= work  # Each task's wall time, shared.
  assert timeline_lib.simulate(*args, schedule=name, concurrency=2.0
                               ).events == plain.events
  half = timeline_lib.simulate(*args, schedule=name, concurrency=0.5)
  assert half.step_time == pytest.approx(2 * work)
  between = timeline_lib.simulate(*args, schedule=name, concurrency=1.5)
  assert plain.step_time <= between.step_time + 1e-9 <= work + 1e-9
  with pytest.raises(ValueError, match=r"concurrency=0 must be > 0"):
    timeline_lib.simulate(*args, concurrency=0)
