"""Trainers: the backends that run a cohort's local training.

``sequential`` and ``process`` (:mod:`.backends`, :mod:`.parallel`), ``ray``
(:mod:`.ray`), ``vmap`` (:mod:`.vmap`), ``lockstep`` (:mod:`.lockstep`) and
``auto`` (:mod:`.auto`), each behind the backend protocol of
:mod:`fedloom.capabilities`; a round hands one its jobs and takes its results.
"""
