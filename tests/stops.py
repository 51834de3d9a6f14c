"""Stand-ins for a process killed mid-way, shared by the tests that check runs never lose data."""
from pathlib import Path


class Stop(BaseException):
    """The process stops here, as at a kill (not an Exception: nothing on the way may catch it)."""


def save_dies_halfway(self, folder, **kw):
    """For PreTrainedModel.save_pretrained: what a kill inside it leaves, config.json and no weights."""
    Path(folder).mkdir(parents=True, exist_ok=True)
    self.config.save_pretrained(folder)
    raise Stop
