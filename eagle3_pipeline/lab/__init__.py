"""The lab: experiments ("lanes") declared as records and run over a base run directory (docs/lab.md)."""
