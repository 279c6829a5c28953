"""The modelling file that export copies into every drafter folder; decoding imports its verification rule from it,
so that evaluated and served drafts are accepted by one implementation.
"""
