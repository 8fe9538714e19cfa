"""Client selection (``cohort.selection``): who of the available clients trains in a round.

Each selector is a registered plug-in of kind ``selector`` (:mod:`fedloom.registry`)
behind :class:`~fedloom.selection.base.Selector`: ``uniform`` (the default),
``power_of_choice`` (Cho, Wang & Joshi 2022, rpow-d) and ``oort`` (Lai et al., OSDI
2021). A selector sees only what a server sees (:mod:`fedloom.selection.base`); its
state rides in the run state and the checkpoints.
"""

from fedloom.selection.base import Feedback, Selector, no_feedback
from fedloom.selection.oort import Oort
from fedloom.selection.power import PowerOfChoice
from fedloom.selection.uniform import Uniform

__all__ = ["Feedback", "Oort", "PowerOfChoice", "Selector", "Uniform", "no_feedback"]
