"""kvcodec.hf"""
