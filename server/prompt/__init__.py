"""From request fields to prompt tokens and constraints: the tokenization codec (codec.py: private
tokenizer copies on their own threads), chat messages and templates (chat.py), tools and the tool-call
parser, and structured-output specs with their compile service. Imports only server.http."""
