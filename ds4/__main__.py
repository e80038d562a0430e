"""`python -m ds4 [group=option ...] [key=value ...]`: compose the config, hand it to `app.run`.

The config directory is absolute (computed from this file), so it is found the same way from a
source checkout and from an installed package; `hydra.job.name` is set to `ds4` in the config.
"""
from __future__ import annotations

from pathlib import Path

import hydra
from omegaconf import DictConfig

CONF_DIR = str(Path(__file__).resolve().parent / "conf")


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="config")
def main(cfg: DictConfig) -> None:
    from ds4 import app
    app.run(cfg)


if __name__ == "__main__":
    main()
