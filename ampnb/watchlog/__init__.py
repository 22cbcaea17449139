"""What a watch writes and what reads it back: the records, their JSON-lines log, their tables.

Data only, below the watch and below what draws it (`plots/watch.py`, `panels/watch_panel.py`),
so that those read a run without importing the watch that records it. `ampnb.watch.records`
and `ampnb.watch.table` re-export them under the watch's own name.
"""
