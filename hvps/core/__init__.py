"""The foundations every other room stands on: errors, settings, dtypes and the array and scaling rules.

Nothing here talks to another rank or imports a framework at module level, so each piece is
unit-testable alone and any layer may use it.
"""
