"""How ranks agree on what runs next: the authenticated TCP control plane and the negotiation over it.

Tensors never travel here, only requests, responses and errors: the data plane (``hvps.dataplane``)
moves the bytes once the ranks have agreed.
"""
