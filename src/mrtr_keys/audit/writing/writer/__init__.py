"""The audit writer: the parent's handle (`parent`) and the writer process (`child`)."""
