"""seedfed: federated zeroth-order fine-tuning where devices upload one scalar per perturbation.

The sides live in their own folders and import as `seedfed.shared` (protocol and math),
`seedfed.client` (the device) and `seedfed.server` (the coordinator). This package holds only
what stands above both: the command line and the fleet simulation that starts a coordinator
and simulated devices together.
"""

__version__ = "0.1.0"
