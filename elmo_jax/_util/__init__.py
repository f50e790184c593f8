"""Small helpers with no elmo_jax imports: atomic writes (``atomic``), a background thread
(``background``), the compile cache and platform checks (``runtime``), reading compiled HLO (``hlo``),
errors marked with the arguments they speak of (``arguments``),
writes that fail for want of space (``disk_full``)."""
