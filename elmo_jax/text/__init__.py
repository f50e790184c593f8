"""Words in: a tokenizer for raw text (``tokenize``), training and evaluation text sources
(``sources``), and building a vocabulary from them (``vocab``)."""
