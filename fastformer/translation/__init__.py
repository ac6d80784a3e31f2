"""Translating text with a trained model: the Translator (translator.py), BLEU on a test split (evaluate.py),
OPUS-MT (Marian) models read into fastformer (marian.py) and models written for CTranslate2 (export.py). Uses the
model, its checkpoints, the data's tokenizer and the compiled search; imports nothing of training."""
