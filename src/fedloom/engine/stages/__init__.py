"""The stages of a round, in the order it calls them.

plan (:mod:`.plan`) → train (a trainer) → uplink (:mod:`.uplink`) → receive
(:mod:`.receive`, with :mod:`.screen`) → server (:mod:`.server`) → scatter
(:mod:`.scatter`) → tally (:mod:`.tally`) → evaluation (:mod:`.evaluation`).
Each takes the values it reads and returns what it makes.
"""
