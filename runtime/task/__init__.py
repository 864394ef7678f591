"""The synthetic task a real job learns: its tokenizer, problem generator and reward."""
