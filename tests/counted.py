"""A random-access source that counts its reads, for tests of how often
the host reads the data."""


class CountedRows:
  """A random-access source of rows ``{"x": x[i]}`` that counts its reads."""

  def __init__(self, x):
    self.x, self.reads = x, 0

  def __len__(self):
    return len(self.x)

  def __getitem__(self, i):
    self.reads += 1
    return {"x": self.x[i]}
