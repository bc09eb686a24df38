"""Device configuration: idempotence, too-late errors, GPU logic on CPU."""

import subprocess
import sys
import textwrap

import pytest
import tensorflow as tf

import tfmgpu
from tfmgpu import devices
from tests.conftest import NUM_LOGICAL_DEVICES


def test_logical_cpus_exist():
  assert tfmgpu.list_devices("CPU") == [
      f"/device:CPU:{i}" for i in range(NUM_LOGICAL_DEVICES)]


def test_same_request_again_is_a_no_op():
  layout = tfmgpu.configure_devices(logical_cpus=NUM_LOGICAL_DEVICES)
  assert len(layout.cpus) == NUM_LOGICAL_DEVICES
  assert layout.accelerators == layout.cpus  # No GPU here.


def test_different_request_after_init_says_call_it_first():
  with pytest.raises(tfmgpu.DeviceConfigurationError,
                     match=r"logical_cpus=2 cannot be applied: TensorFlow is "
                     r"already initialised with 4 logical CPU.*restart the kernel"):
    tfmgpu.configure_devices(logical_cpus=2)


def test_logical_gpus_without_gpu_is_a_clear_error():
  with pytest.raises(ValueError, match=r"logical_gpus=2 .* found no GPU. Use "
                     r"logical_cpus=2"):
    tfmgpu.configure_devices(logical_gpus=2)


@pytest.mark.parametrize("kwargs,match", [
    ({"logical_cpus": 0}, r"logical_cpus=0 must be a positive integer"),
    ({"logical_gpus": -1}, r"logical_gpus=-1 must be a positive integer"),
    ({"gpu_memory_limit_mb": 0}, r"gpu_memory_limit_mb=0 must be >= 1"),
])
def test_bad_counts(kwargs, match):
  with pytest.raises(ValueError, match=match):
    tfmgpu.configure_devices(**kwargs)


def test_memory_growth_without_gpu_degrades_with_a_message(caplog):
  layout = tfmgpu.configure_devices(memory_growth=True)
  assert layout.memory_growth is False


def test_virtual_devices_pick_gpu_when_one_exists(monkeypatch):
  calls = []
  fake_gpu = tf.config.PhysicalDevice("/physical_device:GPU:0", "GPU")
  real = tf.config.list_physical_devices
  monkeypatch.setattr(tf.config, "list_physical_devices",
                      lambda t=None: [fake_gpu] if t == "GPU" else real(t))
  monkeypatch.setattr(devices, "configure_devices",
                      lambda **kw: calls.append(kw))
  devices.configure_virtual_devices(4)
  assert calls == [{"logical_gpus": 4}]


def test_virtual_devices_fall_back_to_cpu(monkeypatch):
  calls = []
  monkeypatch.setattr(devices, "configure_devices",
                      lambda **kw: calls.append(kw))
  devices.configure_virtual_devices(3)
  assert calls == [{"logical_cpus": 3, "intra_op_threads": None}]


def test_resolve_devices_names_what_exists():
  assert devices.resolve_devices(["/cpu:1", "CPU:2"]) == [
      "/device:CPU:1", "/device:CPU:2"]
  with pytest.raises(ValueError, match=r"device '/gpu:0' does not exist here. "
                     r"Devices found: /device:CPU:0"):
    devices.resolve_devices(["/gpu:0"])


def _fresh(code: str) -> str:
  out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)],
                       capture_output=True, text=True, timeout=120,
                       check=False)
  assert out.returncode == 0, out.stderr[-2000:]
  return out.stdout


@pytest.mark.parametrize("cores,logical,expected", [
    (2, 4, 1), (16, 4, 4), (16, 1, 0)])  # At least 1; cores / devices; unsplit.
def test_split_cpu_shares_the_cores_between_devices(cores, logical, expected):
  """In a fresh process: the split, its threads, and the same request
  again a no-op returning the same layout."""
  out = _fresh(f"""
      import tensorflow as tf
      import tfmgpu
      from tfmgpu import devices
      devices.cpu_cores = lambda: {cores}
      a = tfmgpu.configure_devices(logical_cpus={logical})
      b = tfmgpu.configure_devices(logical_cpus={logical})  # Idempotent.
      assert a == b and len(a.cpus) == {logical}, (a, b)
      print(tfmgpu.list_devices("CPU"))
      print(tf.config.threading.get_intra_op_parallelism_threads())
  """)
  assert f"/device:CPU:{logical - 1}'" in out, out
  assert out.split()[-1] == str(expected)  # 0: TensorFlow's default kept.


def test_intra_op_threads_chosen_by_the_user_are_kept():
  out = _fresh("""
      import tensorflow as tf
      import tfmgpu
      tf.config.threading.set_intra_op_parallelism_threads(3)
      tfmgpu.configure_devices(logical_cpus=2)
      a = tf.config.threading.get_intra_op_parallelism_threads()
      tfmgpu.configure_devices(logical_cpus=2, intra_op_threads=0)
      print(a, tf.config.threading.get_intra_op_parallelism_threads())
  """)
  assert out.split()[-2:] == ["3", "3"]


def test_intra_op_threads_after_init_says_call_it_first():
  with pytest.raises(tfmgpu.DeviceConfigurationError,
                     match=r"intra_op_threads=5 cannot be applied.*restart "
                     r"the kernel"):
    tfmgpu.configure_devices(logical_cpus=NUM_LOGICAL_DEVICES,
                             intra_op_threads=5)
  with pytest.raises(ValueError, match=r"intra_op_threads=-1 must be an "
                     r"integer >= 0"):
    tfmgpu.configure_devices(intra_op_threads=-1)
