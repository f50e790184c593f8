"""Other ELMo implementations' files: bilm-tf/AllenNLP hdf5 weights (``hdf5``) and bilm-tf's
TensorFlow checkpoints, read and written without TensorFlow (``tf_checkpoint``)."""
