"""Random-access sources that several test modules read, those of tests of
worker processes (``processes=True``) among them.

Here, not in a test module, because a worker process unpickles a source by
importing the module that defines it: this one imports NumPy alone, so
workers start as a user's do whose source needs no JAX, in well under a
second, rather than importing JAX, pytest and the tests with it.
"""

import io
import os
import pickle
import struct
import sys
import time

import numpy as np


class Computed:
  """``n`` records computed from the index, read one by one; record
  ``fail_at`` fails to read."""

  def __init__(self, n, fail_at=None):
    self.n = n
    self.fail_at = fail_at

  def __len__(self):
    return self.n

  def __getitem__(self, i):
    if i == self.fail_at:
      raise KeyError(f"record {i} is unreadable")
    return {"x": np.int64(i)}


class ComputedInBatches(Computed):
  """:class:`Computed`, read in batches; counts the batched reads."""

  def __init__(self, n, fail_at=None):
    super().__init__(n, fail_at)
    self.reads = 0

  def __getitems__(self, indices):
    self.reads += 1
    return [self[i] for i in indices]


class Numbered:
  """Record i is {"x": float32(i)}; ``die_at`` ends the process reading it
  (os._exit) while the file ``once`` does not exist (None: every time)."""

  def __init__(self, n=30, die_at=None, once=None):
    self.n, self.die_at, self.once = n, die_at, once

  def __len__(self):
    return self.n

  def __getitem__(self, i):
    if i == self.die_at and not (self.once and os.path.exists(self.once)):
      if self.once:
        open(self.once, "w").close()
      os._exit(3)
    return {"x": np.float32(i)}


class HalfWritten(Numbered):
  """Record ``die_at`` ends the process reading it while it writes its
  result (half a message left in the results' pipe, as a worker killed
  for memory mid-write leaves it), while the file ``once`` does not exist
  (None: every time)."""

  def __getitem__(self, i):
    if i == self.die_at and not (self.once and os.path.exists(self.once)):
      if self.once:
        open(self.once, "w").close()
      frame = sys._getframe()  # pylint: disable=protected-access
      while "result_queue" not in frame.f_locals:  # the pool's worker loop
        frame = frame.f_back
      writer = frame.f_locals["result_queue"]._writer  # pylint: disable=protected-access
      writer._send(struct.pack("!i", 1 << 20) + b"half")  # pylint: disable=protected-access
      os._exit(3)
    return super().__getitem__(i)


class Sleepy(Numbered):
  """Records sleep ``delay`` seconds once the file ``after`` exists."""

  def __init__(self, after, delay, n=40):
    super().__init__(n)
    self.after, self.delay = after, delay

  def __getitem__(self, i):
    if os.path.exists(self.after):
      time.sleep(self.delay)
    return super().__getitem__(i)


class Gated:
  """Records after the first wait for ``gate`` (a threading.Event, or a
  file for worker processes); ``entered`` notes each record started (a
  list, or a folder in which a worker process writes a file named by the
  record, holding its pid)."""

  def __init__(self, gate, entered):
    self.gate, self.entered = gate, entered

  def __len__(self):
    return 50

  def __getitem__(self, i):
    if i:
      if isinstance(self.entered, list):
        self.entered.append(i)
        self.gate.wait(60)
      else:
        path = os.path.join(self.entered, str(i))
        with open(path + ".tmp", "w") as f:
          f.write(str(os.getpid()))
        os.replace(path + ".tmp", path)  # seen whole, or not at all
        while not os.path.exists(self.gate):
          time.sleep(0.01)
    return {"x": np.float32(i)}


class JaxImported(Numbered):
  """Record i is {"x": float32(i), "jax": 1 if the process reading it has
  imported JAX, else 0}; ``nested`` puts x one level down
  ({"x": {"v": ...}}), which only JAX takes apart."""

  def __init__(self, n=30, nested=False):
    super().__init__(n)
    self.nested = nested

  def __getitem__(self, i):
    x = super().__getitem__(i)["x"]
    return {"x": {"v": x} if self.nested else x,
            "jax": np.int8("jax" in sys.modules)}


def decode(record):
  """The transform of encoded records (module level: it pickles)."""
  from PIL import Image
  data = pickle.loads(record)
  return {"image": np.asarray(Image.open(io.BytesIO(data["png"]))),
          "label": np.int64(data["label"])}
