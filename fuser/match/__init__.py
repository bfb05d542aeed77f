"""Matching: finding the chains to fuse in a canonical graph, and the guards that accept or reject them.

    patterns       the chains fuser fuses, declared as data (kinds of fuser.graph_ops in data-flow order)
    matcher        the one generic matcher (networkx DiGraphMatcher) that finds them
    chain          a matched chain and what it says about the fused op
    guards         the ordered checks every fusion must pass, each giving the reason it failed
    tree_patterns  small tree patterns with declared commutativity, for the written-out forms that
                   canonicalization and the activation table read

This package imports nothing itself, so fuser.graph_ops and fuser.activations can read tree_patterns
without loading the matcher.
"""
