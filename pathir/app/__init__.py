"""The application layer: the ``pathir`` command line (:mod:`.cli`, :mod:`.commands`),
the demo, the torchvision zoo and ``pathir check`` (:mod:`.checks`). Nothing below
imports it."""
