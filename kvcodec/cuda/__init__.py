"""kvcodec.cuda"""
