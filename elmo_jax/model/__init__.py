"""The biLM itself, as pure functions: characters -> char CNN -> biLSTM.

``vocabulary`` (words and their character ids), ``char_cnn``, ``lstm``, ``bilm`` (the two put
together), ``initializers``, and ``layout`` (how the math is laid out on a backend). No training,
file formats or downloads in here.
"""
