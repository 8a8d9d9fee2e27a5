"""How a user gets a released model's files: the one hint that every
error about a missing checkpoint folder ends with. Imports nothing."""


def download_hint(name: object) -> str:
  """What to do when `name` is no folder: download it, then pass the folder.

  Args:
    name: what the user passed (a hub name such as "openai/gpt-oss-20b").

  Returns:
    The hint, a clause without a final period.
  """
  return (
      "it takes a folder of a checkpoint's files: download a released "
      f"model first, `hf download {name} --local-dir DIR` (pip install "
      "huggingface_hub), then pass DIR"
  )
