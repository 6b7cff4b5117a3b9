"""The evaluation room: HellaSwag's file, scoring under TP and DP, command and callback (docs/structure.md)."""
