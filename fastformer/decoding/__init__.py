"""The compiled search behind `Transformer.translate`: the model's weights converted for the extension
(compiled.py), the rules every search obeys (rules.py, shared with the reference search) and the search's driver
(search.py), with its vocabulary shortlists (shortlist.py); and the teacher-forced scoring behind `Transformer.score`
(scoring.py). Below the model: it imports nothing of fastformer but the compiled extension fastformer._C."""
