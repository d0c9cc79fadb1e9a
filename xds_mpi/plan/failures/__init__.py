"""Failure rows checked before launch: every `faults.events` row against the deployment
(`checks.py`), a lost decode die's scaling (`loss.py`), memory faults in expert slots
(`slots.py`), the rows on a PD run's decode dies (`pd.py`), and what a rolled-back attempt
costs on the virtual clock (`rollback_cost.py`)."""
