"""Training of the small models shipped in `models/tiny` (not on the serving path): the corpus and tokenizer
(`corpus`), a functional Llama for training (`tiny_llama`), the training loop and its CLI (`train`:
`python -m models.training.train --out=DIR`)."""
