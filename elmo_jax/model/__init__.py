"""The biLM itself, as pure functions: characters -> char CNN -> biLSTM.

``vocabulary`` (words and their character ids), ``char_cnn``, ``lstm`` (``cell``: its step, forward
and backward; ``wavefront``: its layers in one scan), ``bilm`` (the two put together), ``initializers``, ``gather`` (row gathers whose gradients sum repeated rows without a
scatter-add), ``layout`` (how the math is laid out on a backend) and ``compute``
(``Compute``: the matmul precision, compute dtype and layout that the char CNN, LSTM and biLM take as
``compute=``). No training, file formats or downloads in here.
"""
